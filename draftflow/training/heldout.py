"""Held-out acceptance while training: which sequences are held out, and what the drafter accepts on them.

A share of the training sequences (`train.heldout_fraction`, chosen by a hash of their ids, so the same ones
on every rank and on every resume) is never trained on. Every `train.eval_every` steps the drafter proposes on
them teacher-forced: each kind's objective builds its usual batch with a fixed seed (`heldout_batch`: DFlash's
anchored blocks over the whole vocabulary, EAGLE-3's unroll), and a block accepts its leading slots that equal
the target's next tokens. The sequences are the target's own greedy regenerations, so this is what greedy
speculative decoding would accept at those positions: τ = 1 + mean accepted drafts, and the share of blocks
that accept at least k drafts for each k (evaluate reports the same figures by decoding).

What it does not know: optimizers, checkpoints, Prefect (the loop in `draftflow.training.loop` keeps the
history and the best weights). Trade-off: held-out sequences cost training data (5% by default) but need no
generation: evaluate's prompts are never regenerated, so measuring on them would cost a greedy decode per
measurement.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch

from draftflow import progress
from draftflow.features import FeatureSample
from draftflow.training.checkpoint import full_weights
from draftflow.training.distributed import DistEnv, all_reduce_max, all_reduce_sum, is_fsdp, uncounted_passes

logger = logging.getLogger(__name__)

MAX_HELDOUT = 512  # sequences: beyond this a measurement costs more than it tells


def _rank(sample_id: str) -> str:
    return hashlib.sha256(f"heldout:{sample_id}".encode()).hexdigest()


def heldout_indices(sample_ids: list[str], fraction: float) -> list[int]:
    """Indices of the sequences held out: the `fraction` (at least 1, at most `MAX_HELDOUT`, never all) whose
    hashed ids come first. Depends on the ids only, so it is the same on every rank and every resume."""
    n = len(sample_ids)
    if fraction <= 0 or n < 2:
        return []
    k = min(MAX_HELDOUT, n - 1, max(1, round(fraction * n)))
    return sorted(sorted(range(n), key=lambda i: _rank(sample_ids[i]))[:k])


class Subset:
    """A view of a sample source (a list, or a stream with `take`) restricted to `indices`, in their order."""

    def __init__(self, source: Any, indices: list[int], lengths: list[int] | None):
        self.source, self.indices = source, list(indices)
        ids = source.sample_ids if hasattr(source, "sample_ids") else [s.sample_id for s in source]
        self.sample_ids = [ids[i] for i in self.indices]
        self.lengths = None if lengths is None else [lengths[i] for i in self.indices]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> FeatureSample:
        return self.take([i])[0]

    def take(self, idx: list[int]) -> list[FeatureSample]:
        outer = [self.indices[i] for i in idx]
        return self.source.take(outer) if hasattr(self.source, "take") else [self.source[i] for i in outer]

    def prefetch(self, idx: list[int]) -> None:
        if hasattr(self.source, "prefetch"):
            self.source.prefetch([self.indices[i] for i in idx])


def split(samples: Any, lengths: list[int] | None, fraction: float) -> tuple[Any, Subset | None]:
    """(the sequences to train on, the held-out ones or None when nothing is held out)."""
    ids = list(samples.sample_ids) if hasattr(samples, "sample_ids") else [s.sample_id for s in samples]
    held = heldout_indices(ids, fraction)
    if not held:
        return samples, None
    chosen = set(held)
    rest = [i for i in range(len(ids)) if i not in chosen]
    return Subset(samples, rest, lengths), Subset(samples, held, lengths)


@torch.no_grad()
def measure(drafter, objective, heldout: Subset, device: torch.device, env: DistEnv, n_slots: int) -> dict:
    """Teacher-forced acceptance on `heldout`: {"tau", "acceptance" (per draft position k=1..n), "blocks"}.

    Each rank measures its share of the sequences; the counts are summed over ranks."""
    was_training = drafter.training
    drafter.eval()
    hist = torch.zeros(n_slots + 1, dtype=torch.float64)  # blocks that accepted exactly 0..n drafts
    mine = env.share(list(range(len(heldout))))
    built = [(j, objective.heldout_batch(s, j)) for j, s in zip(mine, heldout.take(mine), strict=True)]
    keys, batches = [j for j, b in built if b is not None], [b for _, b in built if b is not None]
    passes = len(batches)
    if is_fsdp(drafter):  # every rank runs as many forwards (each gathers the shards): agree first, then pad
        passes = all_reduce_max(len(batches), env)
        if passes > len(batches):
            spare = batches[:1] or [b for j in range(len(heldout)) if (b := objective.heldout_batch(heldout[j], j))]
            batches += [None] * (passes - len(batches))
    with uncounted_passes(drafter):  # FSDP counts a step's forward passes: these are none of them
        for i, b in enumerate(batches):
            if b is None:  # a padding pass: its result is not counted
                objective.loss(drafter, spare[0].to(device))
                continue
            leading = _accepted(drafter, objective, b.to(device), keys[i])
            hist += torch.bincount(leading.to(torch.int64).clamp(max=n_slots), minlength=n_slots + 1).double()
    hist = all_reduce_sum(hist, env)
    if was_training:
        drafter.train()
    return summary(hist.tolist())


def _accepted(drafter, objective, b: Any, key: int) -> torch.Tensor:
    """Accepted drafts per block of one held-out batch: the objective's own cheaper count where it has one (EAGLE-3's
    pruned unroll; not under FSDP, whose shards only a forward pass gathers), else its loss's statistics."""
    if hasattr(objective, "accepted") and not is_fsdp(drafter):
        return objective.accepted(drafter, b, key)
    return objective.loss(drafter, b).leading


def summary(hist: list[float]) -> dict:
    """τ and per-position acceptance from a histogram of accepted drafts per block (index = drafts accepted)."""
    blocks = sum(hist)
    if blocks == 0:
        return {"tau": None, "acceptance": [0.0] * (len(hist) - 1), "blocks": 0}
    tau = 1.0 + sum(k * c for k, c in enumerate(hist)) / blocks
    at_least = [sum(hist[k:]) / blocks for k in range(1, len(hist))]
    return {"tau": round(tau, 6), "acceptance": [round(a, 6) for a in at_least], "blocks": int(blocks)}


def curve(history: list[dict], width: int = 40) -> str:
    """A τ-against-step plot in text (a bar per measurement), for logs and the UI's markdown."""
    taus = [h["tau"] for h in history if h.get("tau") is not None]
    if not taus:
        return "(no held-out measurement yet)"
    low, high = min(taus), max(taus)
    best = max(taus)
    lines = []
    for h in history:
        if h.get("tau") is None:
            continue
        filled = 1 + round((width - 1) * (h["tau"] - low) / (high - low)) if high > low else width
        mark = "  <- best" if h["tau"] == best else ""
        lines.append(f"{h['step']:>8}  {h['tau']:.3f}  {'#' * filled}{mark}")
    return "    step  tau\n" + "\n".join(lines)


# ----------------------------------------------------------------------------- in the training loop


def after_measurement_step(run: Any, state: dict) -> None:
    """Measure the held-out acceptance (`run`: the loop's `_Run`); keep the best drafter's weights in `state`;
    stop when `train.patience` runs out."""
    m = measure(run.drafter, run.objective, run.heldout_set, run.device, run.env, run.objective.n_slots)
    state["heldout"].append({"step": state["step"], **m})
    reweight(run.objective, state["heldout"])
    best = state["best"]
    if m["tau"] is not None and (best is None or m["tau"] > best["tau"]):
        state["best"], state["since_best"] = {"step": state["step"], "tau": m["tau"]}, 0
        if run.tcfg.keep == "best":
            # every rank (FSDP gathers; rank 0 holds them); copies: on CPU the tensors are the live parameters
            state["best_weights"] = {k: v.clone() for k, v in full_weights(run.drafter).items()}
    else:
        state["since_best"] += 1
    best = state["best"]
    tau = "n/a" if m["tau"] is None else f"{m['tau']:.3f}"
    note = f"held-out tau {tau}" + (f" (best {best['tau']:.3f} at step {best['step']})" if best else "")
    progress.report("train", state["step"], run.total, "steps", note=note)
    logger.info("step %d/%d %s; acceptance by position %s", state["step"], run.total, note,
                " ".join(f"{a:.3f}" for a in m["acceptance"]))
    if run.tcfg.patience and state["since_best"] >= run.tcfg.patience and state["step"] < run.total:
        state["stopped_early"] = state["step"]
        logger.info("stopping early at step %d: no better held-out tau in %d measurements (train.patience)",
                    state["step"], run.tcfg.patience)
    if run.hooks.on_heldout is not None and run.env.is_main:
        run.hooks.on_heldout(list(state["heldout"]))


def at_start(run: Any, state: dict, warm: bool) -> None:
    """Before the first step of this call: a resumed run weighs its slots as it did when it stopped; a warm start
    (`train.init_from`) is measured at step 0, so `measured` slot weights start from what the drafter it starts from
    accepts (not the paper's decay, then a jump), and under keep: best a run that never beats its start exports
    the drafter it started from."""
    reweight(run.objective, state["heldout"])
    if warm and run.heldout_set is not None and state["step"] == 0:
        after_measurement_step(run, state)


def reweight(objective: Any, history: list[dict]) -> None:
    """Hand the newest held-out acceptance to an objective that weighs its slots by it (`reweight`; DFlash under
    `train.gamma: measured`); also on resume, from the history the checkpoint holds, so it equals a run never
    stopped."""
    if history and hasattr(objective, "reweight") and history[-1].get("blocks"):
        objective.reweight(history[-1]["acceptance"])


def run_metrics(run: Any, state: dict) -> dict:
    if run.heldout_set is None:
        return {}
    best, history = state["best"], state["heldout"]
    kept = best["step"] if run.tcfg.keep == "best" and best is not None else state["step"]
    at_kept = next((h for h in history if h["step"] == kept), history[-1] if history else {})
    return {"heldout": history, "heldout_sequences": len(run.heldout_set), "heldout_tau": at_kept.get("tau"),
            "heldout_acceptance": at_kept.get("acceptance"), "best_step": None if best is None else best["step"],
            "kept_step": kept, "stopped_early": state["stopped_early"]}


def markdown(history: list[dict], kept_step: int | None = None) -> str:
    """The held-out history as a markdown document: the τ-against-step plot, then a table by step."""
    if not history:
        return "No held-out measurement yet."
    n = len(history[-1].get("acceptance") or [])
    head = "| step | tau | " + " | ".join(f"accept@{k}" for k in range(1, n + 1)) + " |"
    rule = "|---|---|" + "---|" * n
    rows = [f"| {h['step']}{' (kept)' if h['step'] == kept_step else ''} | "
            f"{'-' if h.get('tau') is None else format(h['tau'], '.4f')} | "
            + " | ".join(f"{a:.3f}" for a in h.get("acceptance") or []) + " |" for h in history]
    return ("### Held-out acceptance while training (teacher-forced)\n\n```\n" + curve(history) + "\n```\n\n"
            + "\n".join([head, rule, *rows]) + "\n")
