"""Held-out acceptance while training (`draftflow.training.heldout` and the loop): which sequences are held out,
what is measured, the best checkpoint kept, early stop, resume, and the objective options of both kinds."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from draftflow import progress
from draftflow.config import DrafterConfig, RunConfig, TrainConfig
from draftflow.drafters.dflash.config import DFlashConfig
from draftflow.drafters.dflash.model import DFlashDrafter
from draftflow.drafters.dflash.objective import DFlashObjective, dflash_loss
from draftflow.drafters.objectives import chain_gain, slot_terms
from draftflow.evaluation.decode import capture_taps
from draftflow.features import FeatureSample
from draftflow.layers import FINAL
from draftflow.training import heldout
from draftflow.training.distributed import DistEnv
from draftflow.training.loop import Hooks, train_drafter
from tests.conftest import MASK_ID, B, preempt_training


@pytest.fixture(scope="module")
def samples(target, dcfg):
    """24 prompts of random tokens continued by the tiny target's own greedy answers, with the final state."""
    g = torch.Generator().manual_seed(2)
    prompts = torch.randint(0, MASK_ID, (24, 5), generator=g)
    out = target.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=19,
                          min_new_tokens=19, pad_token_id=0)
    result = []
    for i, ids in enumerate(out.tolist()):
        _, feats = capture_taps(target, ids, [*dcfg.target_layer_ids, FINAL])
        mask = torch.tensor([0] * 5 + [1] * 19, dtype=torch.bool)
        result.append(FeatureSample(f"s{i}", torch.tensor(ids), mask, feats.reshape(24, 4, 64)))
    return result


def taps_only(samples):
    return [FeatureSample(s.sample_id, s.input_ids, s.loss_mask, s.hidden[:, :3]) for s in samples]


def tcfg(**kw) -> TrainConfig:
    base = dict(epochs=50, max_steps=12, batch_size=2, lr=3e-3, num_anchors=8, checkpoint_every=5, device="cpu",
                eval_every=2, heldout_fraction=0.25, init_from_target=False)
    return TrainConfig(**(base | kw))


# ----------------------------------------------------------------------------- which, and what is measured


def test_held_out_sequences_depend_on_their_ids_only():
    ids = [f"id{i}" for i in range(40)]
    held = heldout.heldout_indices(ids, 0.1)
    assert len(held) == 4 and held == sorted(held)
    shuffled = ids[::-1]
    assert {shuffled[i] for i in heldout.heldout_indices(shuffled, 0.1)} == {ids[i] for i in held}
    assert heldout.heldout_indices(ids[:1], 0.5) == [] and heldout.heldout_indices(ids, 0.0) == []
    assert len(heldout.heldout_indices(ids[:3], 0.01)) == 1  # at least one, never every sequence
    assert len(heldout.heldout_indices(ids[:2], 0.49)) == 1


def test_summary_is_tau_and_the_share_accepting_each_position():
    s = heldout.summary([2.0, 1.0, 0.0, 1.0])  # 4 blocks: accepted 0, 0, 1, 3 drafts
    assert s["tau"] == pytest.approx(1 + 4 / 4) and s["blocks"] == 4
    assert s["acceptance"] == pytest.approx([0.5, 0.25, 0.25])
    plot = heldout.curve([{"step": 10, "tau": 1.2}, {"step": 20, "tau": 1.5}, {"step": 30, "tau": 1.4}])
    assert "20  1.500" in plot and plot.count("<- best") == 1 and "<- best" in plot.splitlines()[2]


def test_measure_counts_the_leading_accepted_drafts_of_every_block(target, dcfg, samples):
    torch.manual_seed(0)
    drafter = DFlashDrafter(dcfg, target)
    obj = DFlashObjective(dcfg, tcfg())
    seqs = taps_only(samples[:5])
    m = heldout.measure(drafter, obj, heldout.Subset(seqs, range(5), None), torch.device("cpu"), DistEnv(), B - 1)
    leading = torch.cat([obj.loss(drafter, obj.heldout_batch(s, j)).leading for j, s in enumerate(seqs)])
    assert m["blocks"] == leading.numel() and m["tau"] == pytest.approx(1 + leading.float().mean().item())
    assert m["acceptance"][0] == pytest.approx((leading >= 1).float().mean().item())


# ----------------------------------------------------------------------------- the loop


def test_the_best_drafter_is_exported_with_its_history(tmp_path, target, dcfg, samples):
    heard = []
    m = train_drafter(taps_only(samples), target, dcfg, tcfg(keep="best", max_steps=16, lr=2e-2), str(tmp_path),
                      hooks=Hooks(on_heldout=heard.append))
    steps = [h["step"] for h in m["heldout"]]
    assert steps == list(range(2, 17, 2)) and m["heldout_sequences"] == 6
    best = max(m["heldout"], key=lambda h: h["tau"])
    assert m["best_step"] == m["kept_step"] == best["step"] and m["heldout_tau"] == best["tau"]
    assert heard[-1] == m["heldout"] and len(heard) == len(steps)
    assert "held-out tau" in progress.snapshot("train").note
    # the exported weights are the best step's: measuring them again gives its tau
    drafter = DFlashDrafter.load(tmp_path, target)
    assert best["step"] != 16  # (else this test would not tell the best drafter from the last)
    held = heldout.split(taps_only(samples), None, 0.25)[1]
    again = heldout.measure(drafter, DFlashObjective(dcfg, tcfg()), held, torch.device("cpu"), DistEnv(), B - 1)
    assert again["tau"] == pytest.approx(best["tau"])


def test_patience_stops_early_and_keeps_the_best(tmp_path, monkeypatch, target, dcfg, samples):
    taus = iter([1.1, 1.3, 1.2, 1.25, 1.9, 2.0])

    def scripted(*args, **kw):
        return {"tau": next(taus), "acceptance": [0.1] * (B - 1), "blocks": 10}

    monkeypatch.setattr(heldout, "measure", scripted)
    m = train_drafter(taps_only(samples), target, dcfg, tcfg(keep="best", patience=2), str(tmp_path))
    assert m["stopped_early"] == 8 and m["steps"] == 8  # no better tau at steps 6 and 8
    assert m["best_step"] == m["kept_step"] == 4 and m["heldout_tau"] == 1.3
    assert (tmp_path / "checkpoints" / "step_00000008").is_dir()  # the stop is resumable, and resumes as stopped


def test_resume_keeps_the_history_and_the_best_so_far(tmp_path, monkeypatch, target, dcfg, samples):
    data = taps_only(samples)
    full = train_drafter(data, target, dcfg, tcfg(keep="best", lr=2e-2, gamma="measured"), str(tmp_path / "a"))
    restore = preempt_training(monkeypatch, at=8)  # dies in step 8, after the step-5 checkpoint (history to 4)
    with pytest.raises(RuntimeError, match="preempted"):
        train_drafter(data, target, dcfg, tcfg(keep="best", lr=2e-2, gamma="measured"), str(tmp_path / "b"))
    restore()
    resumed = train_drafter(data, target, dcfg, tcfg(keep="best", lr=2e-2, gamma="measured"), str(tmp_path / "b"))
    assert resumed["heldout"] == full["heldout"] and resumed["kept_step"] == full["kept_step"]
    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_warm_start_is_measured_before_its_first_step_and_kept_when_training_only_hurts(tmp_path, target, dcfg,
                                                                                          samples):
    """A refresh warm-started under `measured` weights trained its first steps by the paper's decay, then jumped, and
    exported a drafter worse than the one it started from. Measured at step 0: the weights start from what the
    start accepts, and a run that never beats its start (here a learning rate that wrecks it) keeps the start."""
    from draftflow.drafters.dflash.export import export_vllm_dflash
    from draftflow.training import warm
    from draftflow.training.loop import Start

    data = taps_only(samples)
    cold = train_drafter(data, target, dcfg, tcfg(max_steps=40, keep="last"), str(tmp_path / "cold"))
    export = export_vllm_dflash(tmp_path / "cold", tmp_path / "cold" / "export", target.config)
    init = warm.resolve(str(tmp_path), str(export))

    def warm_start(out: str, **kw):
        return train_drafter(data, target, dcfg, tcfg(keep="best", **kw), str(tmp_path / out),
                             start=Start(init=(init, warm.load(init, target))))

    wrecked = warm_start("wrecked", lr=5.0, max_steps=6, gamma="measured")
    first = wrecked["heldout"][0]
    assert first["step"] == 0 and first["tau"] == pytest.approx(cold["heldout"][-1]["tau"])  # the start, measured
    assert wrecked["kept_step"] == 0 and max(h["tau"] for h in wrecked["heldout"][1:]) < first["tau"]
    kept, start = load_file(str(tmp_path / "wrecked" / "model.safetensors")), load_file(str(tmp_path / "cold" /
                                                                                            "model.safetensors"))
    assert kept.keys() == start.keys() and all(torch.equal(kept[k], start[k]) for k in kept)
    # The first step is already weighed by the start's measured reach, not by the paper's decay.
    paper = warm_start("paper", max_steps=1, gamma=4.0)
    measured = warm_start("measured", max_steps=1, gamma="measured")
    assert measured["first_loss"] != pytest.approx(paper["first_loss"], rel=1e-6)


def test_recipes_fill_what_is_left_unset():
    paper, ours = TrainConfig(recipe="paper"), TrainConfig()
    assert (paper.init_from_target, paper.eval_every, paper.keep) == (False, "off", "last")
    assert (ours.init_from_target, ours.eval_every, ours.keep) == (True, "auto", "best")
    assert (paper.gamma, ours.gamma, TrainConfig(eval_every="off").gamma) == (None, "measured", None)
    assert TrainConfig(recipe="paper", keep="best", eval_every=10).keep == "best"
    with pytest.raises(ValueError, match="keep: best and patience need held-out"):
        TrainConfig(eval_every="off", keep="best")
    run = RunConfig.model_validate({"train": {"recipe": "paper"}, "drafter": {"kind": "eagle3", "num_layers": 1}})
    assert run.drafter.distill_top_k is None and run.drafter.acceptance_loss is False
    # a kind's own objective option too (EAGLE-3's scored positions), so a dumped config shows what training uses
    assert run.drafter.draftable == "target" and run.model_dump()["drafter"]["draftable"] == "target"
    ours = RunConfig.model_validate({"drafter": {"kind": "eagle3", "num_layers": 1}})
    assert ours.drafter.draftable == "tokens"
    written = RunConfig.model_validate({"drafter": {"kind": "eagle3", "draftable": "target"}})
    assert written.drafter.draftable == "target"  # a value written out wins over the recipe's
    assert "draftable" not in RunConfig.model_validate({}).model_dump()["drafter"]  # a setting DFlash has not


# ----------------------------------------------------------------------------- objective options


def test_acceptance_weights_have_the_gradient_of_the_expected_accepted_length():
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 10, requires_grad=True)  # 3 chains of 4 drafts
    labels = torch.randint(0, 10, (3, 4))
    valid = torch.ones(3, 4)
    term, alpha = slot_terms(logits.reshape(-1, 10), labels.reshape(-1), None, True)
    alpha, term = alpha.view(3, 4), term.view(3, 4)
    (chain_gain(alpha, valid) * term).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    q = torch.softmax(logits, -1).gather(-1, labels[..., None])[..., 0]  # (3, 4) q(label)
    (-torch.cumprod(q, dim=1).sum()).backward()  # minus the expected accepted drafts
    assert torch.allclose(ours, logits.grad, atol=1e-6)


def test_soft_labels_and_acceptance_change_the_loss_but_not_the_paper_recipe(target, samples):
    torch.manual_seed(0)
    shapes = {k: DFlashConfig.from_target(target.config, DrafterConfig(num_layers=1, block_size=B, num_taps=3, **kw),
                                          MASK_ID) for k, kw in
              {"paper": {}, "soft": {"distill_top_k": 8}, "acc": {"acceptance_loss": True}}.items()}
    assert shapes["soft"].feature_ids[-1] == FINAL and shapes["paper"].feature_ids[-1] != FINAL
    drafter = DFlashDrafter(shapes["paper"], target)
    losses = {}
    for name, cfg in shapes.items():
        obj = DFlashObjective(cfg, tcfg())
        data = samples if cfg.stores_final else taps_only(samples)
        b = obj.batch(data[0], 0, 0)
        losses[name] = obj.loss(drafter, b)
        if name == "paper":
            logits = drafter(b.block_ids, b.block_pos, b.ctx_hidden, b.ctx_pos, b.attn_mask)
            assert losses[name].weighted_sum == dflash_loss(logits, b.labels, B, obj.gamma).weighted_sum
    assert len({round(float(s.weighted_sum.detach()), 5) for s in losses.values()}) == 3
    assert all(torch.equal(s.leading, losses["paper"].leading) for s in losses.values())  # same drafts, same hits


def test_the_metrics_files_hold_the_held_out_history(tmp_path):
    from draftflow.training.metrics import HELDOUT_PNG, METRICS_DIR, SUMMARY_JSON, metrics_table, write_metrics

    history = [{"step": 10, "tau": 1.2, "acceptance": [0.2, 0.0]}, {"step": 20, "tau": 1.3, "acceptance": [0.25, 0.05]}]
    metrics = {"loss": 1.0, "steps": 20, "accuracy": [0.3, 0.1], "heldout": history, "heldout_tau": 1.3,
               "kept_step": 20}
    files = write_metrics(tmp_path, metrics, history=[1.0] * 20)
    assert f"{METRICS_DIR}/{HELDOUT_PNG}" in files
    import json

    assert json.loads((tmp_path / METRICS_DIR / SUMMARY_JSON).read_text())["final"]["heldout"] == history
    events = (tmp_path / METRICS_DIR / "tensorboard").glob("*tfevents*")
    assert b"heldout/tau" in next(events).read_bytes()
    assert {"metric": "heldout_tau", "value": 1.3} in metrics_table(metrics)
    md = heldout.markdown(history, kept_step=20)
    assert "| 20 (kept) | 1.3000 | 0.250 | 0.050 |" in md and "<- best" in md


def test_an_objective_option_a_kind_does_not_take_is_one_line(monkeypatch):
    import dataclasses

    from draftflow.drafters import taps
    from draftflow.errors import ConfigError

    bare = dataclasses.replace(taps.TAP_RULES["dflash"], objective_options=())
    monkeypatch.setitem(taps.TAP_RULES, "dflash", bare)
    with pytest.raises(ConfigError, match=r"^drafter.acceptance_loss=True: drafter.kind=dflash does not train with "
                       r"it \(its objective takes none\); unset it$"):
        taps.check_drafter(DrafterConfig(acceptance_loss=True))
    monkeypatch.undo()
    with pytest.raises(ConfigError, match=r"^drafter.distill_top_k=64 is more than EAGLE-3 scores"):
        taps.check_drafter(DrafterConfig(kind="eagle3", num_layers=1, draft_vocab_size=32, distill_top_k=64))
    taps.check_drafter(DrafterConfig(acceptance_loss=True, distill_top_k=8))  # both kinds take both


def test_measured_slot_weights_follow_the_held_out_reach_and_only_when_asked(dcfg):
    """`train.gamma: measured`: the paper's decay until a held-out measurement, then slot k weighs P(the drafts before
    it accepted), floored; the draftflow recipe's default when it measures held out. The paper's recipe, no held-out
    measurements, or a written gamma keep a fixed decay."""
    from draftflow.drafters.dflash.objective import DFlashObjective, reach_weights, slot_weights

    B = dcfg.block_size
    acceptance = [0.5, 0.2, 0.0] + [0.0] * (B - 4)
    want = torch.tensor([0.0, 1.0, 0.5, 0.2] + [0.01] * (B - 4))
    assert torch.allclose(reach_weights(acceptance, B), want)
    ours = DFlashObjective(dcfg, tcfg())
    assert ours.measured and torch.equal(ours.weights, slot_weights(B, ours.gamma))  # before any measurement
    ours.reweight(acceptance)
    assert torch.allclose(ours.weights, want)
    for kept in (DFlashObjective(dcfg, tcfg(eval_every="off")), DFlashObjective(dcfg, tcfg(recipe="paper")),
                 DFlashObjective(dcfg, tcfg(gamma=2.0))):
        before = kept.weights.clone()
        kept.reweight(acceptance)
        assert torch.equal(kept.weights, before) and not kept.measured
    assert DFlashObjective(dcfg, tcfg(recipe="paper", gamma="measured")).measured
    with pytest.raises(ValueError, match="train.gamma must be > 0"):
        tcfg(gamma=0.0)
