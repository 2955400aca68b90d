"""EAGLE-3: config, taps, the unroll mask and alignment, soft targets, the loss, training, export.

Like the DFlash tests, the rule checks come in pairs: the library passes a check and a
known bug (inputs or targets shifted by one, put back into the library's own source with
tests/mutants.py; an unroll mask causal over steps, patched into the library) fails that
same check.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import draftflow.drafters.eagle3.model as e3
from draftflow.config import DrafterConfig
from draftflow.drafters.eagle3 import batches as e3_batches
from draftflow.drafters.eagle3.batches import make_eagle3_batch
from draftflow.drafters.eagle3.config import Eagle3Config
from draftflow.drafters.eagle3.export import export_eagle3_speculators, export_eagle3_vllm
from draftflow.drafters.eagle3.model import Eagle3Drafter, draft_chain, ttt_attention_mask
from draftflow.drafters.eagle3.objective import (
    Eagle3Objective,
    eagle3_loss,
    eagle3_options_loss,
    every_row,
    reach_steps,
)
from draftflow.drafters.eagle3.taps import default_eagle3_layer_ids, eagle3_layer_ids, eagle3_taps
from draftflow.drafters.objectives import ObjectiveOptions
from draftflow.drafters.registry import load_exported
from draftflow.engines.capture import HFCapture
from draftflow.errors import ConfigError
from draftflow.layers import FINAL, hf_hidden_state_index
from draftflow.training.checkpoint import latest_checkpoint
from draftflow.training.loop import Start, train_drafter
from tests.conftest import preempt_training
from tests.eagle3_setup import TAPS, VD, K, drafter, ecfg, samples, tcfg, vocab  # noqa: F401  (fixtures)
from tests.mutants import put_back

# ----------------------------------------------------------------------------- config, taps, shapes


def test_taps_follow_vllm_and_specforge_and_bad_settings_are_config_errors(target):
    for n in (8, 32, 36):  # draftflow id + 1 = vLLM's boundary index (2, N//2, N-3)
        assert [hf_hidden_state_index(i) for i in default_eagle3_layer_ids(n)] == eagle3_layer_ids(n)
    assert default_eagle3_layer_ids(36) == [1, 17, 32] and eagle3_taps(None, 8) == [1, 3, 4]
    with pytest.raises(ConfigError, match="exactly 3 taps"):
        eagle3_taps([1, 2], 8)
    with pytest.raises(ConfigError, match="strictly increasing"):  # 6 layers: defaults collide
        eagle3_taps(None, 6)
    with pytest.raises(ValueError, match="num_layers"):  # its settings' rule: one layer or more
        DrafterConfig(kind="eagle3", target_layer_ids=TAPS, num_layers=0)
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        Eagle3Config.from_target(target.config, DrafterConfig(kind="eagle3", target_layer_ids=TAPS), 321)


def test_shapes_frozen_shared_modules_and_vocab_maps(drafter, target, vocab, ecfg):
    sd = drafter.trainable_state_dict()
    assert sd["fc.weight"].shape == (64, 3 * 64)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (4 * 16, 2 * 64)  # 2D-wide attention input
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (2 * 16, 2 * 64)
    assert sd["lm_head.weight"].shape == (VD, 64) and sd["t2d"].shape == (320,) and sd["d2t"].shape == (VD,)
    assert not any(k.startswith(("embed_tokens", "target_head")) for k in sd)
    assert drafter.embed_tokens is target.get_input_embeddings() and not drafter.embed_tokens.weight.requires_grad
    assert drafter.target_head is target.lm_head and not drafter.target_head.weight.requires_grad
    assert drafter.param_counts()[1] == 2 * 320 * 64
    used = drafter.draft_to_target(torch.arange(VD))
    assert torch.equal(used, vocab[1].nonzero().squeeze(1))  # draft id i <-> the i-th target id in t2d
    with pytest.raises(ConfigError, match="disagree"):
        Eagle3Drafter(ecfg, target, vocab[0] + 1, vocab[1])


def test_final_feature_is_the_targets_normed_last_state(target, samples):
    ids = samples[0].input_ids
    out = target(input_ids=ids[None], output_hidden_states=True)
    (got,) = HFCapture(target, [1, FINAL]).capture([ids.tolist()])
    torch.testing.assert_close(got[:, 0], out.hidden_states[2][0])  # id 1 = output of layer 1
    torch.testing.assert_close(got[:, 1], out.hidden_states[-1][0])  # after model.norm
    torch.testing.assert_close(target.lm_head(got[:, 1]), out.logits[0])  # the LM head's input


# ----------------------------------------------------------------------------- unroll mask


def test_ttt_mask_rule():
    m = ttt_attention_mask(4, 2)
    assert m.shape == (4, 12)
    for t in range(4):
        assert m[t, :4].tolist() == [p <= t for p in range(4)]  # step 0: rows <= t
        for j in (1, 2):
            assert m[t, 4 * j: 4 * (j + 1)].tolist() == [p == t for p in range(4)]  # steps 1..i: row t only


def _unroll_vs_chain(drafter, sample) -> float:
    """Largest gap between the unroll's logits and chain drafting with the same (forced) tokens."""
    b = make_eagle3_batch(sample, K)
    with torch.no_grad():
        unrolled = drafter.unroll(b.feats, b.step_ids, b.pos)
    ids, gap = sample.input_ids.tolist(), 0.0
    for n in (0, 4, 11, 17):  # anchor row n: the target has read x_0..x_n and produced x_{n+1}
        _, chain = draft_chain(drafter, b.feats[0, : n + 1], ids[1 : n + 2], K, forced=ids[n + 2 : n + 2 + K])
        gap = max(gap, *[float((chain[i] - unrolled[i][0, n]).abs().max()) for i in range(K)])
    return gap


def test_unroll_equals_chain_drafting_and_a_causal_over_steps_mask_does_not(drafter, samples, monkeypatch):
    assert _unroll_vs_chain(drafter, samples[0]) < 1e-5

    # The bug put back into the library's mask: step i sees every earlier row of every step.
    put_back(monkeypatch, e3, "ttt_attention_mask", "[same_row] * step", "[causal] * step")
    assert _unroll_vs_chain(drafter, samples[0]) > 1e-3


# ----------------------------------------------------------------------------- alignment


def alignment_errors(b, sample, drafter) -> list[str]:
    """Every way a batch breaks the rule: step i, row t reads x_{t+1+i} and predicts x_{t+2+i}.

    On the target's own greedy answers the target's argmax at position t+1+i *is* x_{t+2+i},
    so the soft target's argmax (mapped back to target ids) must equal it on supervised rows.
    """
    ids, T, errs = sample.input_ids, sample.input_ids.numel(), []
    probs, _ = drafter.soft_targets(b.final[0])  # (T, Vd)
    greedy = drafter.draft_to_target(probs.argmax(-1))
    for i in range(K):
        for t in range(T - 1):
            if t + 1 + i < T and int(b.step_ids[0, i, t]) != int(ids[t + 1 + i]):
                errs.append(f"step {i} row {t}: input {int(b.step_ids[0, i, t])} != x_{t + 1 + i}")
            want_sup = t + 2 + i < T and bool(sample.loss_mask[t + 2 + i])
            if bool(b.supervised[0, i, t]) != want_sup:
                errs.append(f"step {i} row {t}: supervised mask wrong")
            in_vocab = bool(drafter.t2d[ids[t + 2 + i]]) if want_sup else False
            if want_sup and in_vocab and int(greedy[t + 1 + i]) != int(ids[t + 2 + i]):
                errs.append(f"step {i} row {t}: target argmax {int(greedy[t + 1 + i])} != x_{t + 2 + i}")
    return errs


def test_batch_alignment_exact_and_a_shift_by_one_is_caught(drafter, samples):
    s = samples[0]
    b = make_eagle3_batch(s, K)
    T = s.input_ids.numel()
    assert b.feats.shape == (1, T - 1, 3 * 64) and b.final.shape == (1, T, 64) and b.step_ids.shape == (1, K, T - 1)
    torch.testing.assert_close(b.feats[0, 5], s.hidden[5, :3].reshape(-1))  # row t holds h_t
    assert b.step_ids[0, 0, :3].tolist() == s.input_ids[1:4].tolist()  # paired with x_{t+1}
    assert b.supervised[0, 0].tolist() == [*s.loss_mask[2:].tolist(), False]  # predicts x_{t+2}; last row none
    assert alignment_errors(b, s, drafter) == []


@pytest.mark.parametrize(
    "old, new",
    [
        ("ids[src.clamp(max=T - 1)]", "ids[(src + 1).clamp(max=T - 1)]"),  # the peer bug: inputs one token ahead
        ("final=hidden[:, 3][None]", "final=hidden[:, 3].roll(-1, 0)[None]"),  # targets one position late
        ("pred = src + 1", "pred = src + 2"),  # supervision one token late
    ],
)
def test_the_alignment_guard_fails_on_each_shift_put_back(drafter, samples, monkeypatch, old, new):
    """The library's `make_eagle3_batch` with a shift put back into its source fails `alignment_errors`."""
    put_back(monkeypatch, e3_batches, "make_eagle3_batch", old, new)
    assert alignment_errors(e3_batches.make_eagle3_batch(samples[0], K), samples[0], drafter)


# ----------------------------------------------------------------------------- soft targets and loss


def test_soft_targets_sum_to_one_and_exclusions(drafter, samples, vocab):
    b = make_eagle3_batch(samples[1], K)
    probs, in_vocab = drafter.soft_targets(b.final[0])
    torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[0]))
    argmax = drafter.target_head(b.final[0]).argmax(-1)
    assert torch.equal(in_vocab, vocab[1][argmax])
    # Rows outside the draft vocabulary or unsupervised add nothing: change their logits freely.
    torch.manual_seed(0)
    logits = [torch.randn(1, b.feats.shape[1], VD) for _ in range(K)]
    in_vocab = in_vocab.clone()
    in_vocab[5] = False  # pretend: the target's argmax at position 5 is not a draft token
    decays = [0.8**i for i in range(K)]
    st = eagle3_loss(every_row(logits), probs[None], in_vocab[None], b.supervised, decays)
    poked = [lg.clone() for lg in logits]
    poked[0][0, 4, 0] += 100.0  # step 0 row 4 reads its target at position 5: excluded
    poked[1][0, 0, 0] += 100.0  # step 1 row 0 predicts x_3, a prompt token: unsupervised
    assert torch.equal(eagle3_loss(every_row(poked), probs[None], in_vocab[None], b.supervised, decays).weighted_sum,
                       st.weighted_sum)
    poked[0][0, 10, 0] += 100.0  # a supervised row does count
    changed = eagle3_loss(every_row(poked), probs[None], in_vocab[None], b.supervised, decays)
    assert changed.weighted_sum != st.weighted_sum
    assert st.correct.shape == (K,) and st.valid[0] == int((b.supervised[0, 0] & in_vocab[1:]).sum())
    assert st.weight_sum == pytest.approx(sum(0.8**i * float(b.supervised[0, i].sum()) for i in range(K)))


def test_soft_targets_only_where_read_give_the_same_loss_and_gradients(drafter, samples):
    """The target's whole head runs only at the positions a supervised row is scored against (`batch.read`)."""
    b = make_eagle3_batch(samples[0], K)
    assert b.read.sum() < b.read.numel() - 1 and not b.read[0, 0]  # the prompt's positions are never read
    logits = [lg.detach().requires_grad_() for lg in drafter.unroll(b.feats, b.step_ids, b.pos)]
    full, at = drafter.soft_targets(b.final), drafter.soft_targets_at(b.final, b.read)
    assert torch.equal(full[1] & b.read, at[1]) and torch.equal(full[0][b.read], at[0][b.read])
    again = drafter.soft_targets_at(b.final, b.read, at[1])  # in_vocab known: the head's draft rows alone
    assert torch.equal(again[0], at[0]) and torch.equal(again[1], at[1])
    decays = [0.8**i for i in range(K)]
    for options in (None, ObjectiveOptions(4, False), ObjectiveOptions(0, True)):
        grads = []
        for probs, in_vocab in (full, at):
            if options is None:
                st = eagle3_loss(every_row(logits), probs, in_vocab, b.supervised, decays)
            else:
                st = eagle3_options_loss(every_row(logits), probs, in_vocab, b.supervised, decays, options)
            grads.append((st, torch.autograd.grad(st.loss, logits)))
        (one, g1), (two, g2) = grads
        assert torch.isfinite(two.loss) and torch.allclose(one.loss, two.loss, rtol=0, atol=1e-6), options
        assert torch.equal(one.correct, two.correct) and torch.equal(one.valid, two.valid)
        assert all(torch.allclose(x, y, rtol=0, atol=1e-7) for x, y in zip(g1, g2))


# ----------------------------------------------------------------------------- training


def test_loss_decreases_and_frozen_modules_are_not_trained(tmp_path, target, samples, ecfg, vocab):
    head = target.lm_head.weight.clone()
    # every unroll step trained (the paper's decay: no held-out measurement, so no measured unroll depth)
    first = train_drafter(samples, target, ecfg, tcfg(max_steps=1, eval_every="off"), str(tmp_path / "one"),
                          start=Start(vocab))
    m = train_drafter(samples, target, ecfg, tcfg(max_steps=60, checkpoint_every=1000, eval_every="off"),
                      str(tmp_path), start=Start(vocab))
    assert m["steps"] == 60 and m["skipped_sequences"] == 0
    # Soft targets of a random target are nearly uniform: the cross entropy's floor is their entropy,
    # so the loss moves little; the agreement with the target's argmax is what training buys.
    assert m["loss"] < m["first_loss"], m
    assert len(m["accuracy"]) == K and m["tau_est"] > first["tau_est"] + 0.5, (first, m)
    assert all(a > b + 0.1 for a, b in zip(m["accuracy"], first["accuracy"])), (first, m)
    assert torch.equal(target.lm_head.weight, head)
    loaded = Eagle3Drafter.load(tmp_path, target)
    assert torch.equal(loaded.t2d, vocab[1]) and loaded.config == ecfg


def test_measured_unroll_trains_only_the_steps_decoding_reaches(samples, ecfg, drafter):
    # held out on SmolLM2 (docs/results.md): P(at least k accepted) 0.26, 0.05, 0.004, ...: steps 0-2 reached
    assert reach_steps([0.26, 0.05, 0.004, 0.0005, 0.0, 0.0], 7) == [1.0, 0.26, 0.05]
    assert reach_steps([0.0, 0.0], 3) == [1.0] and reach_steps([0.9, 0.8, 0.7], 3) == [1.0, 0.9, 0.8]
    sample = samples[0]
    measured, paper = Eagle3Objective(ecfg, tcfg()), Eagle3Objective(ecfg, tcfg(recipe="paper"))
    assert measured.measured and not paper.measured
    assert measured.batch(sample, 0, 0).step_ids.shape[1] == K  # the paper's decay before the first measurement
    for objective in (measured, paper):
        objective.reweight([0.3, 0.005])
    assert paper.batch(sample, 0, 0).step_ids.shape[1] == K and paper.step_weights == [0.8**i for i in range(K)]
    b = measured.batch(sample, 0, 0)
    assert b.step_ids.shape[1] == 2 and measured.step_weights == [1.0, 0.3]
    assert measured.weight(b) == float(b.supervised[0, 0].sum())  # each reached row weighs 1: step 0's rows normalise
    assert paper.weight(b) == pytest.approx(float(b.supervised[0, 0].sum()) + 0.8 * float(b.supervised[0, 1].sum()))
    stats = measured.loss(drafter, b)
    assert stats.correct.shape == stats.valid.shape == (K,) and stats.valid[2] == 0
    assert stats.valid[1] <= stats.correct[0]  # step 1 runs on the rows whose step-0 draft was accepted only
    held = measured.heldout_batch(sample, 0)  # held-out batches hold every step
    assert held.step_ids.shape[1] == K


def test_resume_equals_uninterrupted_run(tmp_path, monkeypatch, target, samples, ecfg, vocab):
    # one thread count throughout: the chooser's probes at other steps in a resumed run round reductions differently
    monkeypatch.setenv("DRAFTFLOW_TORCH_THREADS", "1")
    full = train_drafter(samples, target, ecfg, tcfg(), str(tmp_path / "a"), start=Start(vocab))
    restore = preempt_training(monkeypatch, at=7)  # dies during step 7, after the step-4 checkpoint
    with pytest.raises(RuntimeError, match="preempted"):
        train_drafter(samples, target, ecfg, tcfg(), str(tmp_path / "b"), start=Start(vocab))
    assert latest_checkpoint(tmp_path / "b").name == "step_00000004"
    restore()
    assert train_drafter(samples, target, ecfg, tcfg(), str(tmp_path / "b"), start=Start(vocab)) == full
    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    t2d = vocab[1].clone()  # another draft vocabulary (one token swapped) is another run
    t2d[t2d.nonzero()[0]], t2d[(~t2d).nonzero()[0]] = False, True
    other = (t2d.nonzero().squeeze(1) - torch.arange(VD), t2d)
    with pytest.raises(ConfigError, match="different settings"):
        train_drafter(samples, target, ecfg, tcfg(max_steps=12), str(tmp_path / "b"), start=Start(other))


# ----------------------------------------------------------------------------- export


def _logits(model, sample) -> list[torch.Tensor]:
    b = make_eagle3_batch(sample, K)
    with torch.no_grad():
        return model.unroll(b.feats, b.step_ids, b.pos)


@pytest.mark.parametrize("export", [export_eagle3_vllm, export_eagle3_speculators])
def test_export_round_trip_same_logits(tmp_path, drafter, target, samples, export):
    drafter.save(tmp_path / "ckpt")
    out = export(tmp_path / "ckpt", tmp_path / "out", target.config)
    cfg = json.loads((out / "config.json").read_text())
    names = set(load_file(str(out / "model.safetensors")))
    assert cfg["draft_vocab_size"] == VD and cfg["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]  # ids + 1
    assert cfg["norm_before_residual"] is False  # vLLM's speculators path defaults it to True
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    assert not any("embed_tokens" in n or "target_head" in n for n in names)
    layer, n = "midlayer." if export is export_eagle3_vllm else "layers.0.", drafter.config.num_layers
    assert f"{layer}self_attn.q_proj.weight" in names and f"{layer}hidden_norm.weight" in names
    # a layer after the first is vLLM's `layers.1.` in both formats, a plain Llama layer (no hidden_norm)
    assert ({"layers.1.self_attn.q_proj.weight", "layers.1.mlp.down_proj.weight"} <= names) == (n == 2)
    assert not any(name.startswith(("later.", "layers.1.hidden_norm")) for name in names)
    if export is export_eagle3_vllm:
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == n
    else:
        assert cfg["speculators_model_type"] == "eagle3" and cfg["transformer_layer_config"]["num_hidden_layers"] == n
        assert cfg["transformer_layer_config"]["vocab_size"] == 320
        assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == K
    loaded = load_exported(out, target).eval()
    assert torch.equal(loaded.d2t, drafter.d2t) and torch.equal(loaded.t2d, drafter.t2d)
    for got, want in zip(_logits(loaded, samples[2]), _logits(drafter, samples[2]), strict=True):
        assert torch.equal(got, want)
