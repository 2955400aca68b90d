"""Predicted speedup on the evaluating engine: measured step costs and per-position acceptance, and the setting
`draftflow.evaluation.serve_choice` would serve with them.

What evaluate measures here, on its own engine (transformers; vLLM's served costs are
`draftflow.evaluation.served`'s), at one typical context, batch 1, KV-cached:

- t_step: the target's plain decode step (one new token);
- t_verify(k): the target's forward over the anchor and k drafts, for every k up to the drafter's most;
- t_draft: one proposal of each proposer at that context, through the reference proposer
  (`DrafterSpec.propose`, which re-projects the context every call: an upper bound on a cached serving drafter),
  scaled to k drafts as the kind drafts (`serve_choice.drafting_costs`: DFlash one block pass, EAGLE-3 one pass a
  draft, prompt lookup free).

With the evaluation's per-position acceptance (a_j = P(at least j drafts accepted)), `serve_choice.predict` gives
every (proposer, k) a predicted speedup over plain decoding and `serve_choice.choose` the setting to serve: the
same model and the same choice as the served path, on the costs of this engine. (This replaces the "projected
speedup" of Leviathan et al. 2023, Theorem 3.8 with the block's full width: it assumed every draft is worth its
verification slot, and printed the drafter's full width however little its later drafts were accepted.)

The costs are the median of a few timed repetitions after a warm-up. They are measurements: they vary with load
and device, are not fingerprinted content, and no test asserts their values. Prompt lookup is modelled as drafting
on every step (its undrafted steps verify one position in truth, so it is predicted a little pessimistically).
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from draftflow.compat import importing_transformers
from draftflow.evaluation import serve_choice

MODEL = "predicted(k) = tau(k) * t_step / (t_verify(k) + t_draft(k)), tau(k) = 1 + a_1 + ... + a_k; best k"
REPEATS = 7
WARMUP = 2
DRAFTING = serve_choice.DRAFTING  # how each proposer's drafting pass scales with k drafts, by its name


@dataclass(frozen=True)
class Candidate:
    """One proposer of the evaluation, as the prediction needs it.

    Attributes:
        name: its key in the report (`drafter`, or a baseline's name); label: its settings' prefix
            (`dflash`, `eagle3`, `prompt_lookup`); acceptance: a_j for j = 1..K (the evaluation's acceptance_rate);
        how: how its drafting pass scales with k (`DRAFTING`'s values).
    """

    name: str
    label: str
    acceptance: list[float]
    how: str


def median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int = REPEATS, warmup: int = WARMUP) -> float:
    """Median wall time of `fn()` over `repeats` calls after `warmup` untimed ones (CUDA synchronised)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return max(statistics.median(times), 1e-9)  # a coarse clock must not give a zero cost


def device_label(device: torch.device) -> str:
    """The evaluation device in words: the GPU's name, or the CPU and the torch threads used."""
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    cpu = platform.processor() or platform.machine()
    return f"{device.type}: {cpu}, {torch.get_num_threads()} torch threads"


@torch.no_grad()
def _target_costs(target, seq: list[int], block: list[int], device: torch.device) -> dict[int, float]:
    """n -> seconds of a forward over n new positions after `seq` (KV-cached), for n = 1..len(block)."""
    with importing_transformers():
        from transformers import DynamicCache

    cache = DynamicCache()
    target(input_ids=torch.tensor([seq], device=device), past_key_values=cache, use_cache=True)

    def forward(ids: list[int]) -> None:
        target(
            input_ids=torch.tensor([ids], device=device),
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=True,
        )  # a speculative step also reads the tap features
        cache.crop(-len(ids))  # back to the context's n positions

    return {n: median_seconds(lambda n=n: forward(block[:n]), device) for n in range(1, len(block) + 1)}


def measure(
    target, proposers: dict[str, Callable[[], list[int]]], seq: list[int], anchor: int, width: int
) -> dict[str, Any]:
    """Step costs at one context: the target's decode step, its verify step of every width, each proposer's pass.

    Args:
        proposers: name -> a call making one proposal at this context (the drafter's first).
        seq: the context the target has read; anchor: the token after it.
        width: most positions one verify step reads (1 + most drafts per step).

    Returns:
        target_step_s, verify_s (k drafts -> seconds, k = 1..width-1), proposer_step_s (each), context_tokens,
        positions_verified (width), repeats, device.
    """
    device = target.get_input_embeddings().weight.device
    drafts = {name: median_seconds(fn, device) for name, fn in proposers.items()}
    block = ([anchor] + seq[-(width - 1) :] * width)[:width] if width > 1 else [anchor]  # any ids: cost only
    per_width = _target_costs(target, seq, block, device)
    return {
        "target_step_s": per_width[1],
        "verify_s": {n - 1: t for n, t in per_width.items() if n >= 2},
        "proposer_step_s": drafts,
        "context_tokens": len(seq) + 1,
        "positions_verified": width,
        "repeats": REPEATS,
        "device": device_label(device),
    }


# A verify step timed below this share of a decode step is no measurement (on a GPU verifying 8-16 positions costs
# about one decode step, and the timer's noise falls either side; below it, it is noise or load).
NOISE = 0.9


def sanity(costs: dict[str, Any]) -> str | None:
    """Why the measured costs cannot give a prediction (None: they can). Verifying k drafts reads the same weights
    as decoding one token plus more positions, so a verify step timed well below one decode step is timer noise
    or load (one demo measured 6.4 ms against 9.6 ms for 8 positions)."""
    if not costs["verify_s"]:
        return None
    k = max(costs["verify_s"])
    if costs["verify_s"][k] < NOISE * costs["target_step_s"]:
        return (f"verify step ({costs['verify_s'][k] * 1e3:.2f} ms for {k + 1} positions) measured cheaper than "
                f"one decode step ({costs['target_step_s'] * 1e3:.2f} ms): timing noise")
    return None


def speedups(costs: dict[str, Any], candidates: list[Candidate]) -> dict[str, Any]:
    """The speedup record of the report: `costs`, every candidate setting's prediction, and the choice.

    Args:
        costs: `measure`'s result. candidates: the drafter first, then the baselines that draft (their names as
            in `costs['proposer_step_s']`); a candidate with no acceptance (no drafting step) is left out.

    Returns:
        `costs` plus predicted (the drafter's predicted speedup at its best k; None when withheld or unmeasured),
        drafter_setting, predicted_per_proposer / setting_per_proposer (each candidate's best), choice (the
        setting to serve on this engine at batch 1, `serve_choice.choose`), table, model, withheld.
    """
    step = costs["target_step_s"]
    verify = {k: max(t, step) for k, t in costs["verify_s"].items()}  # noise never makes verifying cheaper
    proposers = {c.name: serve_choice.Proposer(c.label, list(c.acceptance), serve_choice.drafting_costs(
        costs["proposer_step_s"].get(c.name, 0.0), len(c.acceptance), c.how)) for c in candidates if c.acceptance}
    withheld = sanity(costs)
    best: dict[str, tuple[str, float] | None] = dict.fromkeys(c.name for c in candidates)
    choice = None
    if not withheld and verify:
        bcosts = serve_choice.Costs(step, verify)
        for name, p in proposers.items():
            one = serve_choice.choose([p], bcosts, margin=0.0)  # this proposer's best k, however slow
            best[name] = (one.best_speculative, one.best_predicted) if one.table else None
        choice = serve_choice.choose(list(proposers.values()), bcosts)
    first = candidates[0].name if candidates else None
    return costs | {
        "predicted": best[first][1] if first and best.get(first) else None,
        "drafter_setting": best[first][0] if first and best.get(first) else None,
        "predicted_per_proposer": {n: (b[1] if b else None) for n, b in best.items()},
        "setting_per_proposer": {n: (b[0] if b else None) for n, b in best.items()},
        "choice": None if choice is None else {"setting": choice.setting, "predicted": choice.predicted,
                                               "best_speculative": choice.best_speculative,
                                               "best_predicted": choice.best_predicted},
        "table": choice.table if choice else {},
        "withheld": withheld,
        "model": MODEL,
        "measured": "median wall times of a few repetitions on the evaluation engine after a warm-up, batch 1; "
        "they vary with load and are not fingerprinted",
    }
