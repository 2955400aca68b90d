"""Training options that make a CPU budget go further: the sampled softmax and layers started from the target."""

from __future__ import annotations

import pytest
import torch

from draftflow.config import DrafterConfig
from draftflow.drafters.batches import IGNORE, sampled_vocab
from draftflow.drafters.dflash.batches import build_training_batch
from draftflow.drafters.dflash.model import DFlashDrafter
from draftflow.drafters.dflash.objective import DFlashObjective
from draftflow.drafters.eagle3.config import Eagle3Config
from draftflow.drafters.eagle3.model import Eagle3Drafter
from draftflow.models.weights import init_from_target_layers
from draftflow.training.loop import Start, train_drafter
from tests.conftest import MASK_ID, greedy_samples
from tests.test_train import tcfg, weights


@pytest.fixture(scope="module")
def samples(target, dcfg):
    g = torch.Generator().manual_seed(1)
    return greedy_samples(target, dcfg, torch.randint(0, MASK_ID, (6, 5), generator=g).tolist())


def test_sampled_vocab_scores_kept_tokens_and_labels_exactly_and_corrects_the_drawn_ones():
    labels = torch.tensor([[IGNORE, 7, 300, IGNORE, 9]])
    keep = torch.tensor([1, 2, 7])
    ids, bias = sampled_vocab(labels, keep, 320, 10, torch.Generator().manual_seed(0))
    assert torch.equal(ids, ids.sort().values) and ids.unique().numel() == ids.numel() == 5 + 10
    exact = {1, 2, 7, 9, 300}
    assert exact <= set(ids.tolist())
    for i, b in zip(ids.tolist(), bias.tolist(), strict=True):
        assert b == (0.0 if i in exact else pytest.approx(torch.tensor(315 / 10).log().item()))
    again = sampled_vocab(labels, keep, 320, 10, torch.Generator().manual_seed(0))
    assert torch.equal(again[0], ids)  # the step's generator decides: a resumed step draws the same


def test_sampled_softmax_drawing_every_other_token_is_the_full_loss(target, dcfg, samples):
    """With negatives >= the rest of the vocabulary every token is scored with bias log(1) = 0:
    the sampled loss must equal the paper's full-vocabulary loss exactly."""
    drafter = DFlashDrafter(dcfg, target)
    full_obj = DFlashObjective(dcfg, tcfg())
    sampled_obj = DFlashObjective(dcfg, tcfg(sampled_softmax=10_000))
    sampled_obj.loss_tokens = torch.tensor([3, 4, 5])
    full_b, sampled_b = full_obj.batch(samples[0], 0, 0), sampled_obj.batch(samples[0], 0, 0)
    assert full_b.vocab is None and sampled_b.vocab.numel() == dcfg.vocab_size
    full, sampled = full_obj.loss(drafter, full_b), sampled_obj.loss(drafter, sampled_b)
    assert sampled.loss.item() == pytest.approx(full.loss.item(), rel=1e-5)
    assert torch.equal(sampled.correct, full.correct)


def test_sampled_softmax_scores_fewer_rows_and_still_trains(tmp_path, target, dcfg, samples):
    obj = DFlashObjective(dcfg, tcfg(sampled_softmax=16))
    obj.loss_tokens = torch.tensor([3, 4, 5])
    b = obj.batch(samples[0], 0, 0)
    logits = DFlashDrafter(dcfg, target)(b.block_ids, b.block_pos, b.ctx_hidden, b.ctx_pos, b.attn_mask,
                                         b.vocab, b.vocab_bias)
    assert logits.shape[-1] == b.vocab.numel() < dcfg.vocab_size
    loss_tokens = torch.unique(torch.cat([s.input_ids for s in samples]))
    m = train_drafter(samples, target, dcfg, tcfg(max_steps=12, sampled_softmax=32), str(tmp_path / "s"),
                      start=Start(loss_tokens=loss_tokens))
    train_drafter(samples, target, dcfg, tcfg(max_steps=12), str(tmp_path / "p"))
    assert m["loss"] < m["first_loss"]
    assert not torch.equal(weights(tmp_path / "s")["fc.weight"], weights(tmp_path / "p")["fc.weight"])


def test_dflash_layers_start_as_the_targets_last_layers(target, dcfg):
    drafter = DFlashDrafter(dcfg, target)
    copied = init_from_target_layers(drafter, target)
    last = target.model.layers[-1].state_dict()
    mine = drafter.layers[0].state_dict()
    assert sorted(copied) == sorted(f"0.{k}" for k in mine)  # Qwen3 target: every tensor of the layer
    for k, v in mine.items():
        assert torch.equal(v, last[k]), k
    assert not torch.equal(drafter.fc.weight[:, :64], drafter.fc.weight[:, :64] * 0)  # fc keeps its own init


def test_eagle3_copies_what_fits_and_maps_its_wider_attention_inputs_and_fc(target):
    """q/k/v read [embedding, hidden]: their hidden half starts as the target layer's, the embedding half keeps its
    own init; fc starts as the identity on the deepest tap, so the layer first reads that tap as its hidden."""
    ecfg = Eagle3Config.from_target(target.config, DrafterConfig(kind="eagle3", target_layer_ids=[1, 2, 3]), 64)
    d2t = torch.zeros(64, dtype=torch.int64)  # offsets: draft id i is token i + d2t[i]
    t2d = torch.zeros(target.config.vocab_size, dtype=torch.bool)
    t2d[:64] = True
    drafter = Eagle3Drafter(ecfg, target, d2t, t2d)
    D, last = ecfg.hidden_size, target.model.layers[-1]
    attn_before = {n: getattr(drafter.midlayer.self_attn, n).weight.clone() for n in ("q_proj", "k_proj", "v_proj")}
    copied = set(init_from_target_layers(drafter, target))
    assert {"0.mlp.up_proj.weight", "0.self_attn.o_proj.weight", "0.post_attention_layernorm.weight",
            "0.hidden_norm.weight", "0.self_attn.q_proj.weight (hidden half)"} <= copied
    for name, before in attn_before.items():
        mine = getattr(drafter.midlayer.self_attn, name).weight
        assert torch.equal(mine[:, D:], getattr(last.self_attn, name).weight), name
        assert torch.equal(mine[:, :D], before[:, :D]), name  # the embedding half: no target tensor reads it
    assert torch.equal(drafter.midlayer.hidden_norm.weight, last.input_layernorm.weight)
    assert torch.equal(drafter.midlayer.mlp.up_proj.weight, last.mlp.up_proj.weight)
    taps = torch.randn(2, 5, 3 * D)
    assert torch.equal(drafter.fc(taps), taps[..., 2 * D:])  # the deepest tap (layer 3), unchanged


def test_eagle3_of_two_layers_starts_as_the_targets_last_two(target):
    """`midlayer` maps the second-to-last target layer as one layer maps the last; the layer after it (a plain
    Llama layer) takes every tensor of the last whose name matches (a Qwen3 target's q/k norms have no place)."""
    ecfg = Eagle3Config.from_target(target.config, DrafterConfig(kind="eagle3", target_layer_ids=[1, 2, 3],
                                                                 num_layers=2), 64)
    drafter = Eagle3Drafter(ecfg, target, torch.zeros(64, dtype=torch.int64),
                            torch.arange(target.config.vocab_size) < 64)
    D, (before, last) = ecfg.hidden_size, target.model.layers[-2:]
    copied = set(init_from_target_layers(drafter, target))
    later = drafter.later[0].state_dict()
    assert {f"1.{k}" for k in later} <= copied and "0.self_attn.q_proj.weight (hidden half)" in copied
    for k, v in later.items():
        assert torch.equal(v, last.state_dict()[k]), k
    assert torch.equal(drafter.midlayer.self_attn.q_proj.weight[:, D:], before.self_attn.q_proj.weight)
    assert torch.equal(drafter.midlayer.hidden_norm.weight, before.input_layernorm.weight)
    assert torch.equal(drafter.midlayer.mlp.up_proj.weight, before.mlp.up_proj.weight)


def test_eagle3_leaves_its_own_init_where_the_target_layer_is_not_llama_shaped(target):
    ecfg = Eagle3Config.from_target(target.config, DrafterConfig(kind="eagle3", target_layer_ids=[1, 2, 3]), 64)
    drafter = Eagle3Drafter(ecfg, target, torch.zeros(64, dtype=torch.int64),
                            torch.arange(target.config.vocab_size) < 64)
    fc = drafter.fc.weight.clone()
    assert drafter.init_beyond_names([torch.nn.Linear(4, 4)]) == []  # no self_attn, no input_layernorm
    assert torch.equal(drafter.fc.weight, fc)


def test_init_from_target_changes_the_run_and_is_recorded_for_resume(tmp_path, target, dcfg, samples):
    a = train_drafter(samples, target, dcfg, tcfg(max_steps=5, init_from_target=True), str(tmp_path / "a"))
    b = train_drafter(samples, target, dcfg, tcfg(max_steps=5), str(tmp_path / "b"))
    assert a["first_loss"] != b["first_loss"]
    from draftflow.errors import ConfigError

    with pytest.raises(ConfigError, match="different settings"):  # a checkpoint of the other init is not resumed
        train_drafter(samples, target, dcfg, tcfg(max_steps=8), str(tmp_path / "a"))


def test_an_unused_block_batch_field_moves_as_none():
    ids = torch.arange(10, 20)
    mask = torch.ones(10, dtype=torch.bool)
    from draftflow.features import FeatureSample

    b = build_training_batch(FeatureSample("x", ids, mask, torch.randn(10, 3, 8)), 4, 2,
                             torch.Generator().manual_seed(0), MASK_ID)
    assert b.to("cpu").vocab is None
