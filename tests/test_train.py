"""DFlash training: anchors, labels, masks, the block loss, and the resumable loop."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from draftflow.config import TrainConfig
from draftflow.drafters.batches import IGNORE, step_indices
from draftflow.drafters.dflash import batches
from draftflow.drafters.dflash.batches import build_training_batch, make_block_batch, select_anchors
from draftflow.drafters.dflash.objective import default_gamma, dflash_loss, slot_weights
from draftflow.errors import ConfigError, DraftflowError
from draftflow.evaluation.decode import capture_taps
from draftflow.features import FeatureSample
from draftflow.training.checkpoint import latest_checkpoint
from draftflow.training.loop import train_drafter
from draftflow.training.schedule import warmup_cosine
from tests.conftest import MASK_ID, B, preempt_training
from tests.mutants import put_back


@pytest.fixture(scope="module")
def samples(target, dcfg):
    """Prompts of random tokens continued by the tiny target's own greedy answers."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, MASK_ID, (8, 5), generator=g)
    out = target.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        do_sample=False,
        max_new_tokens=19,
        min_new_tokens=19,
        pad_token_id=0,
    )
    result = []
    for i, ids in enumerate(out.tolist()):
        _, feats = capture_taps(target, ids, dcfg.target_layer_ids)
        mask = torch.tensor([0] * 5 + [1] * 19, dtype=torch.bool)
        result.append(FeatureSample(f"s{i}", torch.tensor(ids), mask, feats.reshape(24, 3, 64)))
    return result


def toy_sample(T=10):
    ids = torch.arange(10, 10 + T)
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 0, 1, 1, 1][:T], dtype=torch.bool)
    return FeatureSample("toy", ids, mask, torch.randn(T, 3, 8))


# ----------------------------------------------------------------------------- anchors, labels, mask


def label_errors(batch, sample, block_size) -> list[str]:
    """Every way the batch's labels break the DFlash rule (slot k <- token a+k, same position)."""
    errs = []
    labels = batch.labels.view(-1, block_size)
    for j, a in enumerate(batch.anchors.tolist()):
        for k in range(block_size):
            want = int(sample.input_ids[a + k]) if k >= 1 and sample.loss_mask[a + k] else IGNORE
            if int(labels[j, k]) != want:
                errs.append(f"block {j} slot {k}: {int(labels[j, k])} != {want}")
    return errs


def test_block_inputs_and_labels_exact():
    s = toy_sample()
    b = make_block_batch(s, torch.tensor([2, 5]), B, MASK_ID)
    M = MASK_ID
    assert b.block_ids.tolist() == [[12, M, M, M, 15, M, M, M]]
    assert b.block_pos.tolist() == [[2, 3, 4, 5, 5, 6, 7, 8]]
    # slot 0 never supervised; position 6 has loss_mask 0
    assert b.labels.tolist() == [[IGNORE, 13, 14, 15, IGNORE, IGNORE, 17, 18]]
    assert label_errors(b, s, B) == []
    assert b.ctx_hidden.shape == (1, 10, 24) and b.ctx_pos.tolist() == [list(range(10))]
    m = b.attn_mask[0]
    assert m.shape == (8, 18)
    assert m[:4, :10].tolist() == [[True] * 2 + [False] * 8] * 4  # block 0: p < 2 only
    assert m[4:, :10].tolist() == [[True] * 5 + [False] * 5] * 4  # block 1: p < 5 only
    assert m[:4, 10:].tolist() == [[True] * 4 + [False] * 4] * 4


def supervised_sample(T: int) -> FeatureSample:
    """Distinct tokens, every position supervised: both bounds of the anchor rule are in play."""
    return FeatureSample("all", torch.arange(10, 10 + T), torch.ones(T, dtype=torch.bool), torch.randn(T, 3, 8))


def build_errors(T: int, block_size: int) -> list[str]:
    """Every way the library's `build_training_batch` breaks the rule on `supervised_sample(T)`:
    all anchors a with 1 <= a and a + B <= T (so the last block ends on token T-1, the last
    token, which only it supervises at slot B-1), labels token a+k at slot k."""
    s, want = supervised_sample(T), list(range(1, T - block_size + 1))
    errs = []
    try:
        b = build_training_batch(s, block_size, 4 * T, torch.Generator().manual_seed(0), MASK_ID)
    except IndexError as exc:  # an anchor whose block runs past the end
        return [f"T={T} B={block_size}: {exc}"]
    got = [] if b is None else b.anchors.tolist()
    if got != want:
        errs.append(f"T={T} B={block_size}: anchors {got} != {want}")
    if b is not None:
        errs += label_errors(b, s, block_size)
        labelled = set(b.labels[b.labels != IGNORE].tolist())
        if want and int(s.input_ids[T - 1]) not in labelled:
            errs.append(f"T={T} B={block_size}: the last token is never a label")
    return errs


BOUNDS = [(10, 4), (9, 4), (5, 4), (4, 4), (3, 4), (17, 16), (16, 16), (24, 8)]


def test_anchor_bound_includes_the_block_ending_on_the_last_token():
    assert select_anchors(supervised_sample(10).loss_mask, B, 100, torch.Generator()).tolist() == [1, 2, 3, 4, 5, 6]
    assert [e for T, b in BOUNDS for e in build_errors(T, b)] == []


@pytest.mark.parametrize(
    "old, new",
    [
        ("pos + block_size <= T", "pos + block_size < T"),  # peer bug: the last token is never supervised
        ("pos + block_size <= T", "pos + block_size <= T + 1"),  # a block that runs past the end
        ("(pos >= 1)", "(pos >= 0)"),  # an anchor at 0 has no context at all
    ],
)
def test_the_anchor_guard_fails_on_each_bound_bug_put_back(monkeypatch, old, new):
    put_back(monkeypatch, batches, "select_anchors", old, new)
    assert [e for T, b in BOUNDS for e in build_errors(T, b)]


@pytest.mark.parametrize(
    "old, new",
    [
        ("ids[pos], IGNORE", "ids[(pos + 1).clamp(max=T - 1)], IGNORE"),  # peer bug: slot k learns token a+k+1
        ("ids[pos], IGNORE", "ids[pos - 1], IGNORE"),  # slot k learns token a+k-1 (slot 1: the anchor again)
        ("loss_mask.bool()[pos]", "loss_mask.bool()[anchors][:, None].expand_as(pos)"),  # the anchor's mask for all
    ],
)
def test_the_label_guard_fails_on_each_label_bug_put_back(monkeypatch, old, new):
    """The library's `make_block_batch` with a known bug put back fails `label_errors` (and the exact test)."""
    s = toy_sample()
    assert label_errors(make_block_batch(s, torch.tensor([2, 5]), B, MASK_ID), s, B) == []
    put_back(monkeypatch, batches, "make_block_batch", old, new)
    assert label_errors(batches.make_block_batch(s, torch.tensor([2, 5]), B, MASK_ID), s, B)
    every = build_training_batch(s, B, 10, torch.Generator().manual_seed(0), MASK_ID)  # training's path
    assert every.anchors.tolist() == [2, 3, 4, 5] and label_errors(every, s, B)


def test_select_anchors_eligibility_and_uniformity():
    mask = toy_sample().loss_mask.clone()
    mask[0] = True  # a = 0 has no context: never an anchor
    all_ = select_anchors(mask, B, 10, torch.Generator().manual_seed(0))
    assert all_.tolist() == [2, 3, 4, 5]  # loss_mask set, a >= 1, a + B <= T
    counts = torch.zeros(10)
    for seed in range(200):
        pick = select_anchors(mask, B, 2, torch.Generator().manual_seed(seed))
        assert pick.numel() == 2 and torch.equal(pick, pick.sort().values)
        counts[pick] += 1
    assert counts[[2, 3, 4, 5]].min() > 60 and counts.sum() == 400  # ~100 each
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert torch.equal(select_anchors(mask, B, 2, g1), select_anchors(mask, B, 2, g2))


def test_sequence_without_anchor_gives_none():
    s = toy_sample(T=4)
    assert build_training_batch(s, B, 8, torch.Generator().manual_seed(0), MASK_ID) is None


# ----------------------------------------------------------------------------- loss


def test_gamma_and_weights():
    assert [default_gamma(b) for b in (16, 10, 8)] == [7.0, 5.0, 4.0]
    assert default_gamma(4) == 1.5
    w = slot_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1
    torch.testing.assert_close(w[5], torch.tensor(math.exp(-4 / 7)))


def test_loss_is_decayed_and_normalised_over_valid_slots():
    torch.manual_seed(0)
    logits = torch.randn(1, 8, 11)
    labels = torch.tensor([[IGNORE, 3, 4, 5, IGNORE, IGNORE, 7, 8]])
    st = dflash_loss(logits, labels, B, gamma=2.0)
    ce = torch.nn.functional.cross_entropy(logits[0], labels[0].clamp_min(0), reduction="none")
    w = torch.tensor([0, 1, math.exp(-0.5), math.exp(-1), 0, 0, math.exp(-0.5), math.exp(-1)])
    torch.testing.assert_close(st.loss, (ce * w).sum() / w.sum())
    assert st.weight_sum == pytest.approx(float(w.sum()))


def test_accuracy_and_tau_estimate():
    labels = torch.tensor([[IGNORE, 3, 4, 5, IGNORE, IGNORE, 7, 8]])
    pred = torch.tensor([0, 3, 4, 9, 0, 0, 7, 8])  # block 0: 2 leading right; block 1: slot 1 unsupervised
    logits = torch.nn.functional.one_hot(pred, 11).float()[None]
    st = dflash_loss(logits, labels, B, gamma=2.0)
    assert st.leading.tolist() == [2, 0]
    assert st.tau_est == pytest.approx(2.0)
    assert st.accuracy.tolist() == [1.0, 1.0, 0.5]  # slot 1: 1/1, slot 2: 2/2, slot 3: 1/2


# ----------------------------------------------------------------------------- schedule & order


def test_warmup_cosine_and_epoch_order():
    f = warmup_cosine(4, 20)
    assert [f(0), f(3)] == [0.25, 1.0] and f(12) == pytest.approx(0.5) and f(20) == pytest.approx(0)
    tcfg = TrainConfig(batch_size=3, seed=5)
    epoch0 = sum((step_indices(s, 8, tcfg) for s in range(3)), [])
    epoch1 = sum((step_indices(s, 8, tcfg) for s in range(3, 6)), [])
    assert sorted(epoch0) == sorted(epoch1) == list(range(8)) and epoch0 != epoch1


# ----------------------------------------------------------------------------- the loop


def tcfg(**kw) -> TrainConfig:
    base = dict(epochs=50, max_steps=12, batch_size=2, lr=3e-3, num_anchors=8, checkpoint_every=5, device="cpu", seed=0,
                recipe="paper")  # the loop's mechanics; tests/test_heldout.py covers the draftflow recipe's additions
    return TrainConfig(**(base | kw))


def weights(out_dir):
    return load_file(str(out_dir / "model.safetensors"))


def test_loss_decreases_and_frozen_modules_are_not_trained(tmp_path, target, samples, dcfg):
    head_before = target.lm_head.weight.clone()
    m = train_drafter(samples, target, dcfg, tcfg(max_steps=100, checkpoint_every=1000), str(tmp_path))
    assert m["steps"] == 100 and m["skipped_sequences"] == 0
    assert m["loss"] < m["first_loss"] - 0.5, m
    assert m["frozen_params"] == 2 * 320 * 64
    assert m["trainable_params"] == sum(v.numel() for v in weights(tmp_path).values())
    assert torch.equal(target.lm_head.weight, head_before)
    assert len(m["accuracy"]) == B - 1 and m["tau_est"] >= 1.0


def test_resume_equals_uninterrupted_run(tmp_path, monkeypatch, target, samples, dcfg):
    full = train_drafter(samples, target, dcfg, tcfg(), str(tmp_path / "a"))
    again = train_drafter(samples, target, dcfg, tcfg(), str(tmp_path / "b"))
    assert all(torch.equal(weights(tmp_path / "a")[k], v) for k, v in weights(tmp_path / "b").items())

    restore = preempt_training(monkeypatch, at=8)  # dies during step 8, after the step-5 checkpoint
    with pytest.raises(RuntimeError, match="preempted"):
        train_drafter(samples, target, dcfg, tcfg(), str(tmp_path / "c"))
    assert latest_checkpoint(tmp_path / "c").name == "step_00000005"
    restore()
    resumed = train_drafter(samples, target, dcfg, tcfg(), str(tmp_path / "c"))
    a, c = weights(tmp_path / "a"), weights(tmp_path / "c")
    assert set(a) == set(c) and all(torch.equal(a[k], c[k]) for k in a)
    assert resumed == full == again
    ckpts = sorted(p.name for p in (tmp_path / "c" / "checkpoints").iterdir())
    assert ckpts == ["step_00000010", "step_00000012"]  # only the newest two are kept


def test_seed_changes_weights_and_resume_false_restarts(tmp_path, target, samples, dcfg):
    train_drafter(samples, target, dcfg, tcfg(max_steps=3), str(tmp_path / "a"))
    train_drafter(samples, target, dcfg, tcfg(max_steps=3, seed=1), str(tmp_path / "b"))
    assert not torch.equal(weights(tmp_path / "a")["fc.weight"], weights(tmp_path / "b")["fc.weight"])
    again = train_drafter(samples, target, dcfg, tcfg(max_steps=3), str(tmp_path / "a"), resume=False)
    assert again["steps"] == 3


def test_resume_refuses_a_checkpoint_from_other_settings(tmp_path, target, samples, dcfg):
    train_drafter(samples, target, dcfg, tcfg(max_steps=5), str(tmp_path))
    with pytest.raises(ConfigError, match="different settings"):
        train_drafter(samples, target, dcfg, tcfg(max_steps=5, lr=1e-3), str(tmp_path))


# ----------------------------------------------------------------------------- divergence and buckets


def test_nan_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, target, samples, dcfg):
    import draftflow.drafters.dflash.objective as objectives

    real_loss, calls = objectives.dflash_loss, []

    def poisoned(logits, *args):  # the 7th forward (step 4, 2 sequences a step) returns NaN
        calls.append(1)
        return real_loss(logits * float("nan") if len(calls) == 7 else logits, *args)

    monkeypatch.setattr(objectives, "dflash_loss", poisoned)
    with pytest.raises(DraftflowError, match="diverged at step 4"):
        train_drafter(samples, target, dcfg, tcfg(checkpoint_every=2), str(tmp_path))
    assert latest_checkpoint(tmp_path).name == "step_00000002"
    for ckpt in (tmp_path / "checkpoints").glob("step_*"):
        assert all(torch.isfinite(v).all() for v in load_file(str(ckpt / "model.safetensors")).values())
    assert not (tmp_path / "model.safetensors").exists()


def test_length_buckets_are_deterministic_and_group_lengths():
    lengths = [5, 100, 6, 101, 7, 102, 8, 103]
    cfg = tcfg(batch_size=2)
    steps = [step_indices(s, 8, cfg, lengths) for s in range(8)]
    assert steps == [step_indices(s, 8, cfg, lengths) for s in range(8)]
    for batch in steps:
        assert max(lengths[i] for i in batch) - min(lengths[i] for i in batch) <= 3, batch
    assert sorted(sum(steps[:4], [])) == list(range(8))  # an epoch covers every sample once
    assert steps[:4] != steps[4:]  # epochs reshuffle


def test_bucketed_resume_equals_uninterrupted(tmp_path, monkeypatch, target, samples, dcfg):
    mixed = [FeatureSample(s.sample_id, s.input_ids[: 14 + i], s.loss_mask[: 14 + i], s.hidden[: 14 + i])
             for i, s in enumerate(samples)]
    full = train_drafter(mixed, target, dcfg, tcfg(), str(tmp_path / "a"))
    restore = preempt_training(monkeypatch, at=7)
    with pytest.raises(RuntimeError, match="preempted"):
        train_drafter(mixed, target, dcfg, tcfg(), str(tmp_path / "b"))
    restore()
    assert train_drafter(mixed, target, dcfg, tcfg(), str(tmp_path / "b")) == full
    a, b = weights(tmp_path / "a"), weights(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_mask_token_is_len_tokenizer_or_an_unused_added_token_when_the_embedding_has_no_spare_row():
    """SmolLM2's 49,152 embedding rows are all tokens: len(tokenizer) would index past the embedding."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from draftflow.training.job import mask_token_id

    word = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    word.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=word, unk_token="<unk>", eos_token="<|im_end|>")
    tok.add_tokens(["<reserved_a>", "<reserved_b>"], special_tokens=True)
    n = len(tok)
    assert mask_token_id(tok, n + 64) == n  # a spare row: the DFlash default
    assert mask_token_id(tok, n) == tok.convert_tokens_to_ids("<reserved_b>")  # never eos, unk or pad
    tok.add_special_tokens({"additional_special_tokens": ["<reserved_a>", "<reserved_b>"]})
    with pytest.raises(ConfigError, match="set drafter.mask_token_id"):
        mask_token_id(tok, n)
