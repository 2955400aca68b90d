"""Projected speedup: measured step costs on the evaluation device, combined with τ.

The wall-time model of speculative decoding (Leviathan, Kalman and Matias, "Fast Inference from
Transformers via Speculative Decoding", ICML 2023, Theorem 3.8: improvement factor
(1 - α^(γ+1)) / ((1 - α)(γc + 1))) divides the tokens one step yields by what one step costs,
in units of a plain target decode step. Its numerator over (1 - α) is the mean acceptance length
τ; its denominator assumes verification costs one target step and drafting γ steps of relative
cost c. Here both are measured instead:

    speedup = τ · t_step / (t_verify + t_draft)

- t_step: the target's plain decode step, one new token after the context (KV cache);
- t_verify: the target's forward over the B positions [anchor, B-1 drafts] after the same context
  (KV cache), which is what one speculative step verifies;
- t_draft: one proposal of the drafter at that context (DFlash: one block forward; EAGLE-3: its
  whole chain), through the reference proposer (`DrafterSpec.propose`, which re-projects the context
  every call: an upper bound on a cached serving drafter).

With t_verify = t_step and t_draft = γ·c·t_step this is the paper's formula. Each cost is the median
of a few timed repetitions after a warm-up, batch 1. They are measurements: they vary with load and
device, are not fingerprinted content, and no test asserts their values. What the model leaves out:
acceptance bookkeeping, sampling, batching, and the cache rollback of rejected drafts.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

FORMULA = "speedup = tau * t_step / (t_verify + t_draft)"
REPEATS = 7
WARMUP = 2


def projected(tau: float | None, step_s: float, verify_s: float, draft_s: float) -> float | None:
    """`τ · t_step / (t_verify + t_draft)`; None without a τ (no drafting step was taken).

    Raises:
        ValueError: a non-positive step cost (a timer that measured nothing).
    """
    if min(step_s, verify_s) <= 0 or draft_s < 0:
        raise ValueError(f"step costs must be positive: step {step_s}, verify {verify_s}, draft {draft_s}")
    return None if tau is None else tau * step_s / (verify_s + draft_s)


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
def _target_costs(target, seq: list[int], block: list[int], device: torch.device) -> tuple[float, float]:
    """(t_step, t_verify): a forward over 1 and over len(block) new positions after `seq`, KV-cached."""
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

    return median_seconds(lambda: forward(block[:1]), device), median_seconds(lambda: forward(block), device)


def measure(
    target, proposers: dict[str, Callable[[], list[int]]], seq: list[int], anchor: int, width: int
) -> dict[str, Any]:
    """Step costs at one context: the target's decode and verify steps, and each proposer's one proposal.

    Args:
        proposers: name -> a call making one proposal at this context (the drafter's first).
        seq: the context the target has read; anchor: the token after it.
        width: positions one verify step reads (1 + most drafts per step).

    Returns:
        target_step_s, verify_step_s, drafter_step_s (the first proposer's), proposer_step_s (each),
        context_tokens, positions_verified, repeats, device.
    """
    device = target.get_input_embeddings().weight.device
    drafts = {name: median_seconds(fn, device) for name, fn in proposers.items()}
    block = ([anchor] + seq[-(width - 1) :] * width)[:width] if width > 1 else [anchor]  # any ids: cost only
    step_s, verify_s = _target_costs(target, seq, block, device)
    return {
        "target_step_s": step_s,
        "verify_step_s": verify_s,
        "drafter_step_s": next(iter(drafts.values())),
        "proposer_step_s": drafts,
        "context_tokens": len(seq) + 1,
        "positions_verified": width,
        "repeats": REPEATS,
        "device": device_label(device),
    }


# A verify step timed below this share of a decode step is no measurement; between it and 1 it is read as equal
# (on a GPU verifying 8-16 positions costs about one decode step, and the timer's noise falls either side).
NOISE = 0.9


def sanity(costs: dict[str, Any]) -> str | None:
    """Why the measured costs cannot give a projection (None: they can). Verifying B positions reads the
    same weights as decoding one plus more positions, so a verify step timed well below one decode step is
    timer noise or load (one demo measured 6.4 ms against 9.6 ms and projected x2.41, above τ itself)."""
    if costs["verify_step_s"] < NOISE * costs["target_step_s"]:
        return (f"verify step ({costs['verify_step_s'] * 1e3:.2f} ms for {costs['positions_verified']} positions) "
                f"measured cheaper than one decode step ({costs['target_step_s'] * 1e3:.2f} ms): timing noise")
    return None


def speedups(costs: dict[str, Any], taus: dict[str, float | None]) -> dict[str, Any]:
    """The speedup record of the report: `costs` plus the formula and a projection per proposer.

    Args:
        costs: `measure`'s result. taus: proposer name (as in `costs['proposer_step_s']`) -> τ;
            the first is the drafter, whose projection is `projected`. A proposer that drafts
            nothing (`no_draft`) is verified over one position, so its projection is τ = 1 exactly.
    """
    per = {}
    for name, tau in taus.items():
        verify = costs["target_step_s"] if name == "no_draft" else max(costs["verify_step_s"], costs["target_step_s"])
        per[name] = projected(tau, costs["target_step_s"], verify, costs["proposer_step_s"].get(name, 0.0))
    first = next(iter(taus))
    withheld = sanity(costs)
    if withheld:  # a projection from costs that cannot be right is no figure at all
        per = dict.fromkeys(per)
    return costs | {
        "projected": per[first],
        "projected_per_proposer": per,
        "withheld": withheld,
        "formula": FORMULA,
        "measured": "median wall times of a few repetitions on the evaluation device after a warm-up, batch 1; "
        "they vary with load and are not fingerprinted",
    }
