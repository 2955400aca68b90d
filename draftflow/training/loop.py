"""Drafter training: a resumable loop shared by every drafter kind.

A drafter kind is an *objective* (`DrafterSpec.objective`, `draftflow/drafters/<kind>/objective.py`):
how a sequence becomes a batch, its loss weight (known before any forward pass), and forward + loss;
the loop here is shared. DFlash (arXiv 2602.06036): random anchored blocks, slot k's cross entropy
weighted exp(-(k-1)/gamma); EAGLE-3 (arXiv 2503.01840): the training-time-test unroll, step i's soft
cross entropy weighted `ttt_decay ** i` (each written down in its folder).

What it does not know: where features come from (already-loaded `FeatureSample`s), which kind it
trains, or Prefect. Under torchrun each rank trains on its share of every step's global batch
(`draftflow.training.distributed`); checkpoints are local folders, rank 0's.

Key trade-off: one sequence per forward pass (variable T and anchor counts),
with `batch_size` sequences by gradient accumulation. No padding logic and
exact per-step normalisation, at the cost of GPU utilisation on short
sequences. Every random choice derives from (seed, step), so a resumed run
equals an uninterrupted one bit for bit on the same device.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftflow import interrupt, progress
from draftflow.config import DrafterConfig, TrainConfig
from draftflow.drafters.batches import step_indices, total_steps
from draftflow.drafters.objectives import LossStats
from draftflow.drafters.registry import spec_for_architecture
from draftflow.errors import ConfigError, DraftflowError
from draftflow.features import FeatureSample
from draftflow.models.weights import SharedTargetDrafter, init_from_target_layers
from draftflow.target import resolve_device
from draftflow.training import heldout, threads
from draftflow.training.checkpoint import (
    load_checkpoint,
    load_weights,
    resumable_checkpoint,
    save_checkpoint,
    save_drafter,
)
from draftflow.training.distributed import (
    DistEnv,
    adamw,
    all_reduce_sum,
    clip_gradients,
    init_distributed,
    prepare_model,
    sync_gradients,
)
from draftflow.training.schedule import warmup_cosine

logger = logging.getLogger(__name__)

METRIC_WINDOW = 20  # steps averaged into the reported metrics


# ----------------------------------------------------------------------------- one step


@dataclass(frozen=True)
class Hooks:
    """Who hears of a training run's progress (rank 0 only)."""

    on_checkpoint: Callable[[Path], None] | None = None  # each complete checkpoint folder (e.g. copy it to the root)
    on_heldout: Callable[[list[dict]], None] | None = None  # the held-out history after each measurement


@dataclass
class _Run:
    """The live objects of one training run."""

    drafter: SharedTargetDrafter  # a kind's model
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    samples: list[FeatureSample]
    tcfg: TrainConfig
    objective: Any  # a kind's objective (`DrafterSpec.objective`)
    total: int
    out_dir: str
    meta: dict
    device: torch.device
    env: DistEnv
    lengths: list[int] | None
    hooks: Hooks = field(default_factory=Hooks)
    thread_chooser: threads.ThreadChooser | None = None  # CPU: the torch thread count, measured on the steps
    heldout_set: heldout.Subset | None = None  # sequences never trained on, measured every `eval_every` steps
    eval_every: int = 0
    saved_step: int | None = None  # the step of the last checkpoint this run wrote
    in_step: bool = False  # a step (or its checkpoint) is under way: its state is half-updated


def _train_step(run: _Run, seqs: list[tuple[int, FeatureSample]], step: int) -> dict[str, Any]:
    """One optimizer step over this rank's `(j, sequence)` pairs, j = place in the global batch.

    Gradient accumulation, one sequence per forward; gradients summed over ranks.

    Raises:
        DraftflowError: the loss or the gradient is NaN/inf (nothing is updated).
    """
    tcfg, obj = run.tcfg, run.objective
    batches = [obj.batch(s, step, j) for j, s in seqs]
    batches = [b for b in batches if b is not None]
    # Normalise by the whole (global) step's valid weight, known before any forward pass.
    w_local = sum(obj.weight(b) for b in batches)
    w_total = float(all_reduce_sum(torch.tensor([w_local], dtype=torch.float64), run.env))
    run.opt.zero_grad(set_to_none=True)
    stats = []
    for b in batches:
        st = obj.loss(run.drafter, b.to(run.device))
        if w_total > 0:
            (st.weighted_sum / w_total).backward()  # summed over ranks by sync_gradients
        stats.append(st)
    params = [p for p in run.drafter.parameters() if p.requires_grad]
    sync_gradients(params, run.env, run.drafter, backward=w_total > 0)  # FSDP: pads passes, reduces
    rec = _global_record(_step_record(stats, w_total, obj.n_slots, skipped=len(seqs) - len(batches)), run.env)
    grad_norm = clip_gradients(params, tcfg.grad_clip)
    if (rec["loss"] is not None and not math.isfinite(rec["loss"])) or not torch.isfinite(grad_norm):
        raise DraftflowError(
            f"training diverged at step {step + 1}: loss {rec['loss']}, grad norm {float(grad_norm)}; "
            "weights were not updated, the last good checkpoint is kept (lower train.lr or check the features)"
        )
    run.opt.step()  # parameters without gradients (a step with no labels) are left untouched
    run.sched.step()
    return rec


def _global_record(rec: dict, env: DistEnv) -> dict:
    """Sum a rank's step record over all ranks (identity on one process)."""
    if env.world_size == 1:
        return rec
    n = len(rec["correct"])
    loss_sum = 0.0 if rec["loss"] is None else rec["loss"]  # already divided by the global weight
    flat = torch.tensor([loss_sum, rec["loss"] is not None, *rec["correct"], *rec["valid"], rec["leading"],
                         rec["blocks"], rec["skipped"]], dtype=torch.float64)
    flat = all_reduce_sum(flat, env).tolist()
    return {
        "loss": flat[0] if flat[1] > 0 else None,
        "correct": flat[2 : 2 + n],
        "valid": flat[2 + n : 2 + 2 * n],
        "leading": flat[-3],
        "blocks": int(flat[-2]),
        "skipped": int(flat[-1]),
    }


def _step_record(stats: list[LossStats], w_total: float, n_slots: int, skipped: int) -> dict:
    zeros = torch.zeros(n_slots, dtype=torch.float64)
    return {
        "loss": sum(float(s.weighted_sum.detach()) for s in stats) / w_total if w_total > 0 else None,
        "correct": sum((s.correct for s in stats), zeros).tolist(),
        "valid": sum((s.valid for s in stats), zeros).tolist(),
        "leading": float(sum(int(s.leading.sum()) for s in stats)),
        "blocks": sum(int(s.leading.numel()) for s in stats),
        "skipped": skipped,
    }


def _run_meta(samples: list[FeatureSample], dcfg, tcfg: TrainConfig, draft_vocab=None) -> dict:
    """What a checkpoint must agree with to be resumed (device and cadence may change)."""
    launch = {"device", "checkpoint_every", "nproc_per_node", "nnodes", "rdzv_endpoint", "launcher", "parallel",
              "timeout_s", "collective_timeout_s"}
    train = tcfg.model_dump(mode="json", exclude=launch)  # the global batch, not its split
    ids = hashlib.sha256("\n".join(_sample_ids(samples)).encode()).hexdigest()
    meta = {"drafter": dcfg.to_dict(), "train": train, "samples": {"count": len(samples), "ids_sha256": ids}}
    if draft_vocab is not None:  # EAGLE-3: another draft vocabulary is another run
        meta["draft_vocab_sha256"] = hashlib.sha256(draft_vocab[0].cpu().numpy().tobytes()).hexdigest()
    return meta


# ----------------------------------------------------------------------------- the loop


@dataclass(frozen=True)
class Start:
    """What a run starts from besides its samples and config (chosen by `draftflow.training.job`): the vocabularies
    taken from tokenize's token counts, and a warm start."""

    draft: tuple[torch.Tensor, torch.Tensor] | None = None  # EAGLE-3: (d2t, t2d), its draft vocabulary
    loss_tokens: torch.Tensor | None = None  # train.sampled_softmax: the ids always scored (EAGLE-3: draft ids)
    # train.init_from: (`warm.InitDrafter`, the drafter loaded from it); every weight starts from its (checked to
    # fit first), and train.init_from_target is then not applied
    init: tuple[Any, Any] | None = None
    # The run's `drafter` section, for a kind whose objective reads a setting of its own (`<kind>/settings.py`)
    drafter: DrafterConfig | None = None


def _sample_ids(samples) -> list[str]:
    # An online source (draftflow.training.job.OnlineSamples) knows its ids without computing features.
    return list(samples.sample_ids) if hasattr(samples, "sample_ids") else [s.sample_id for s in samples]


def _take(samples, idx: list[int]) -> list[FeatureSample]:
    # An online source computes one step's features in one batched target forward.
    return samples.take(idx) if hasattr(samples, "take") else [samples[i] for i in idx]


def train_drafter(
    samples: list[FeatureSample], target_model, dcfg: Any, tcfg: TrainConfig, out_dir: str,
    resume: bool = True, start: Start | None = None, hooks: Hooks | None = None,
) -> dict:
    """Train a drafter of the kind `dcfg` (a kind's drafter config) names; checkpoint and resume in `out_dir`.

    Args:
        samples: sequences with features in `dcfg`'s order (DFlash: `target_layer_ids`;
            EAGLE-3: `feature_ids`, the 3 taps then FINAL): a list, or an online source
            with `__len__`, `sample_ids` and `take(indices)`.
        target_model: the HF target; only its embedding and LM head are used (frozen,
            and moved to the training device with the drafter).
        dcfg: drafter shape. tcfg: the `train` config section.
        out_dir: local folder; gets `checkpoints/`, the final drafter
            (`model.safetensors`, `config.json`, loadable by the drafter class's `load`)
            and `metrics.json`.
        resume: continue from the newest checkpoint in `out_dir` when there is one.
        start: the vocabularies chosen from tokenize's counts and a warm start (`Start`): EAGLE-3's draft vocabulary,
            DFlash's always-scored tokens under `train.sampled_softmax`.
        hooks: called on rank 0 with each complete checkpoint folder (e.g. to copy it to the run
            root, so a run on another machine resumes from it) and with the held-out history after
            each measurement (`train.eval_every`; `draftflow.training.heldout`).

    Returns:
        Metrics: loss (mean of the last steps), first_loss, accuracy per slot k=1..B-1
        (EAGLE-3: per unroll step; None where no recent step scored it), tau_est, steps, trainable_params,
        frozen_params, skipped_sequences; with held-out sequences also heldout (the history), heldout_tau and
        heldout_acceptance (of the kept drafter), best_step, kept_step, stopped_early.
    """
    if not samples:
        raise ConfigError("no training samples: the extract stage produced no features")
    device = torch.device(resolve_device(tcfg.device))
    env = init_distributed(device, tcfg.collective_timeout_s)
    if device.type == "cuda" and env.world_size > 1:
        device = torch.device("cuda", env.local_rank)
    torch.manual_seed(tcfg.seed)  # drafter init, identical on every rank
    start = start or Start()
    draft_vocab, init = start.draft, start.init
    spec = spec_for_architecture(dcfg.architecture)
    drafter = spec.build(dcfg, target_model, draft_vocab)
    if init is not None:  # before sharding; a resumed run then loads its checkpoint over it
        from draftflow.training.warm import check_and_state

        drafter.load_state_dict(check_and_state(init[0], init[1], drafter), strict=False)
        logger.info("drafter weights warm-started from %s", init[0].folder)
    elif tcfg.init_from_target:  # before sharding; a resumed run then loads its checkpoint over it
        copied = init_from_target_layers(drafter, target_model)
        logger.info("drafter layers initialised from the target's last %d: %d tensors copied",
                    len(drafter.decoder_layers()), len(copied))
    drafter = drafter.to(device)
    drafter = prepare_model(drafter, tcfg, env, device)  # FSDP2 shards (train.parallel), bf16 autocast on CUDA
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = adamw(params, tcfg)  # fused where it can be
    lengths = _lengths(samples)
    train_set, held = heldout.split(samples, lengths, tcfg.heldout_fraction if tcfg.eval_every != "off" else 0.0)
    total = total_steps(len(train_set), tcfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(math.ceil(tcfg.warmup_ratio * total), total))
    objective = spec.objective(dcfg, tcfg, start.drafter)
    if start.loss_tokens is not None:
        objective.loss_tokens = start.loss_tokens
    meta = _run_meta(samples, dcfg, tcfg, draft_vocab)
    run = _Run(drafter, opt, sched, train_set, tcfg, objective, total, out_dir, meta, device, env,
               train_set.lengths if held else lengths, hooks or Hooks(),
               threads.chooser_for(device, env.local_world), held, _eval_every(tcfg, total) if held else 0)
    state: dict[str, Any] = {"step": 0, "history": [], "window": [], "skipped": 0}
    ckpt = resumable_checkpoint(out_dir) if resume else None
    if ckpt is not None:
        state = load_checkpoint(ckpt, drafter, opt, sched, run.meta, device)
        logger.info("resumed from %s at step %d of %d", ckpt, state["step"], total)
    for key, empty in (("heldout", []), ("best", None), ("best_weights", None), ("stopped_early", None),
                       ("since_best", 0)):
        state.setdefault(key, empty)
    heldout.at_start(run, state, warm=init is not None)
    _run_steps(run, state)
    metrics = _metrics(state, drafter) | heldout.run_metrics(run, state)
    if tcfg.keep == "best" and state["best"] is not None and state["best"]["step"] != state["step"]:
        load_weights(drafter, state["best_weights"])  # every rank (FSDP: rank 0's copy is broadcast)
        logger.info("kept the drafter of step %d (held-out tau %.4f), not the last step's", state["best"]["step"],
                    state["best"]["tau"])
    save_drafter(drafter, out_dir, env)  # every rank: FSDP gathers the shards
    if env.is_main:
        (Path(out_dir) / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def _lengths(samples) -> list[int] | None:
    # An online source may expose `lengths`; without them its batches are not bucketed.
    if isinstance(samples, list):
        return [s.input_ids.numel() for s in samples]
    return list(samples.lengths) if hasattr(samples, "lengths") else None


def _run_steps(run: _Run, state: dict) -> None:
    """Train until `run.total`. A stop request (SIGTERM/SIGINT in the CLI) stops it between two steps with a
    checkpoint of the last one: `Interrupted` in a worker thread, the signal's own exception in the main one."""
    with interrupt.stoppable():
        try:
            _steps(run, state)
        except BaseException as exc:  # noqa: BLE001 - re-raised; only signals (not errors) get a checkpoint
            if isinstance(exc, Exception) and not isinstance(exc, interrupt.Interrupted):
                raise
            _stop_here(run, state)
            raise


def _stop_here(run: _Run, state: dict) -> None:
    """Between steps, stopped by a signal: keep the step just done (unless its checkpoint was just written).

    A signal that still lands mid-step (a second Ctrl-C) writes nothing: the state is half-updated, and
    the last complete checkpoint is what a re-run resumes from."""
    # One process only: several ranks would each need the same signal at the same step (FSDP gathers).
    if run.in_step:
        interrupt.stopped(f"train step {state['step']} of {run.total} (mid-step: resumes from the last checkpoint)")
        return
    if run.env.world_size == 1 and run.saved_step != state["step"]:
        _checkpoint(run, state)
    interrupt.stopped(f"train step {state['step']} of {run.total} (checkpoint saved)")


def _steps(run: _Run, state: dict) -> None:
    log_every = max(1, run.total // 20)
    run.drafter.train()
    while state["step"] < run.total and state.get("stopped_early") is None:
        with interrupt.step_boundary():  # in the main thread a signal lands after this step, not inside it
            run.in_step = True
            _one_step(run, state, log_every)
            run.in_step = False
        if interrupt.requested():
            raise interrupt.Interrupted(f"interrupted at train step {state['step']} of {run.total}")


def _one_step(run: _Run, state: dict, log_every: int) -> None:
    idx = step_indices(state["step"], len(run.samples), run.tcfg, run.lengths)
    mine = run.env.share(list(enumerate(idx)))  # (place in the global batch, sample index)
    seqs = list(zip([j for j, _ in mine], _take(run.samples, [i for _, i in mine]), strict=True))
    if hasattr(run.samples, "prefetch") and state["step"] + 1 < run.total:  # read the next step meanwhile
        ahead = step_indices(state["step"] + 1, len(run.samples), run.tcfg, run.lengths)
        run.samples.prefetch([i for _, i in run.env.share(list(enumerate(ahead)))])
    with threads.step(run.thread_chooser, sum(s.input_ids.numel() for _, s in seqs)):
        rec = _train_step(run, seqs, state["step"])
    state["step"] += 1
    state["history"].append(rec["loss"])
    state["window"] = (state["window"] + [rec])[-METRIC_WINDOW:]
    state["skipped"] += rec["skipped"]
    progress.report("train", state["step"], run.total, "steps")
    if state["step"] % log_every == 0 or state["step"] == run.total:
        lr = run.sched.get_last_lr()[0]
        logger.info("step %d/%d loss %s lr %.2e", state["step"], run.total, _fmt(rec["loss"]), lr)
    if run.heldout_set is not None and (state["step"] % run.eval_every == 0 or state["step"] == run.total):
        heldout.after_measurement_step(run, state)  # before the checkpoint of the same step, which then holds it
    due = state["step"] % run.tcfg.checkpoint_every == 0 or state["step"] == run.total
    if due or state["stopped_early"] is not None:
        _checkpoint(run, state)


def _eval_every(tcfg: TrainConfig, total: int) -> int:
    """Steps between held-out measurements: `train.eval_every`, or 20 a run for `auto`."""
    return tcfg.eval_every if isinstance(tcfg.eval_every, int) else max(1, total // 20)


def _checkpoint(run: _Run, state: dict) -> None:
    """Every rank calls it (FSDP gathers the shards); rank 0 writes, then `on_checkpoint` (the store's copy)."""
    folder = save_checkpoint(run.out_dir, run.drafter, run.opt, run.sched, state, run.meta, run.env)
    run.saved_step = state["step"]
    if folder is not None and run.hooks.on_checkpoint is not None:
        run.hooks.on_checkpoint(folder)


def _fmt(loss: float | None) -> str:
    return "n/a" if loss is None else f"{loss:.4f}"


def _metrics(state: dict, drafter: SharedTargetDrafter) -> dict:
    window = state["window"]
    correct = torch.tensor([r["correct"] for r in window]).sum(0)
    valid = torch.tensor([r["valid"] for r in window]).sum(0)
    losses = [r["loss"] for r in window if r["loss"] is not None]
    trainable, frozen = drafter.param_counts()
    return {
        "loss": sum(losses) / len(losses) if losses else None,
        "first_loss": next((x for x in state["history"] if x is not None), None),
        "accuracy": [c / v if v else None for c, v in zip(correct.tolist(), valid.tolist())],  # None: not scored
        "tau_est": 1.0 + sum(r["leading"] for r in window) / max(1, sum(r["blocks"] for r in window)),
        "steps": state["step"],
        "trainable_params": trainable,
        "frozen_params": frozen,
        "skipped_sequences": state["skipped"],
    }
