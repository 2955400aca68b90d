"""Served speedup, measured: the target in vLLM with and without each speculative method, timed.

The projected speedup (`draftflow.evaluation.speedup`) multiplies τ by step costs timed in
transformers; on a small target those costs are mostly framework overhead and the projection can
land above τ itself. This module measures what a server delivers instead: vLLM decodes the same
eval prompts greedily (i) plainly, (ii) with the drafter's vLLM-native export and (iii) with vLLM's
n-gram prompt lookup, each at batch 1 and batch 8 (`evaluate.served_batches`), and reports output
tokens per second, the ratio to plain decoding at the same batch size, vLLM's acceptance length
overall, per category and per draft position, and whether every method's text equals plain
decoding's (lossless, per batch size).

What it does not know: stores, exports' contents or report layout (`render` only formats this
record). Trade-off: each method is one engine start plus two decodes of the prompts (minutes on
a CPU); the figures are this machine's under its current load and are not fingerprinted content.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from draftflow.vllm_serve import ServeJob, serve_with_vllm

log = logging.getLogger(__name__)


def per_category(categories: list[str], per_prompt: list[tuple[int, int]]) -> dict[str, float | None]:
    """vLLM's τ per category from its per-prompt (drafts, accepted) counters."""
    sums: dict[str, list[int]] = {}
    for cat, (drafts, accepted) in zip(categories, per_prompt):
        tot = sums.setdefault(cat, [0, 0])
        tot[0], tot[1] = tot[0] + drafts, tot[1] + accepted
    return {c: (1.0 + a / d if d else None) for c, (d, a) in sorted(sums.items())}


def _record(job: ServeJob, served, plain) -> dict[str, Any]:
    """One method's served figures against plain decoding."""
    lossless = {str(b): served.tokens_by_batch[b] == plain.tokens_by_batch[b] for b in job.batches}
    return {
        "tok_s": {str(b): served.tok_s[b] for b in job.batches},
        "speedup": {str(b): served.tok_s[b] / plain.tok_s[b] if plain.tok_s[b] else None for b in job.batches},
        "tau": served.tau,
        "tau_per_category": per_category(list(job.categories), served.per_prompt),
        "acceptance_rate": served.acceptance_rate,
        "drafts": served.drafts,
        "lossless": lossless,
    }


def measure(job: ServeJob, methods: dict[str, tuple[Path | None, dict[str, Any] | None]],
            greedy: list[list[int]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Plain decoding, then every method, in vLLM on the same prompts.

    Args:
        methods: name -> (export folder, None) or (None, speculative_config); decoded in this order.
        greedy: draftflow's own greedy outputs of the same prompts (how many plain vLLM matches is reported).

    Returns:
        (the `served` record of report.json: batches, plain tokens/s, per method `_record`;
         name -> `ServedResult` of each method, for the caller's lossless and τ checks).
    """
    plain = serve_with_vllm(job)
    first = job.batches[0]
    same = sum(a == b for a, b in zip(plain.tokens_by_batch[first], greedy))
    out: dict[str, Any] = {
        "batches": list(job.batches),
        "prompts": len(job.prompts),
        "max_new_tokens": job.max_new_tokens,
        "dtype": job.dtype,
        "plain": {"tok_s": {str(b): plain.tok_s[b] for b in job.batches},
                  "equal_to_draftflow_greedy": f"{same}/{len(greedy)}"},
        "methods": {},
        "measured": "output tokens/s of vLLM's offline engine after a warm-up request; batch 1 = one request "
        "at a time; this machine under its current load, not fingerprinted",
    }
    runs = {}
    for name, (export, spec) in methods.items():
        runs[name] = serve_with_vllm(job, export, spec)
        out["methods"][name] = _record(job, runs[name], plain)
        log.info("served %s: speedup %s", name, out["methods"][name]["speedup"])
    return out, runs


def _f(x: float | None, spec: str = ".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def render(served: dict[str, Any] | None, draftflow_tau: dict[str, float | None]) -> list[str]:
    """The report.md section: tokens/s and speedup per method and batch size, τ by vLLM next to draftflow's.

    Args:
        draftflow_tau: method name -> draftflow's τ on the same prompts (None where not measured).
    """
    if not served:
        return []
    bs = [str(b) for b in served["batches"]]
    head = " | ".join(f"tok/s b{b} | speedup b{b} | lossless b{b}" for b in bs)
    lines = ["## Served speedup (vLLM, measured)", "",
             f"{served['prompts']} prompts, up to {served['max_new_tokens']} new tokens, {served['dtype']}; "
             f"{served['measured']}. Plain vLLM equals draftflow's greedy text on "
             f"{served['plain']['equal_to_draftflow_greedy']} prompts. Lossless: the method's text equals plain "
             "vLLM's at that batch size. vLLM's prompt lookup counts only steps where it found a match.", "",
             f"| method | τ vLLM | τ draftflow | {head} |", "|---" * (3 + 3 * len(bs)) + "|",
             "| plain | 1.000 | 1.000 | " + " | ".join(f"{served['plain']['tok_s'][b]:.1f} | 1.00 | yes" for b in bs)
             + " |"]
    for name, m in served["methods"].items():
        cells = " | ".join(f"{m['tok_s'][b]:.1f} | {_f(m['speedup'][b], '.2f')} | "
                           f"{'yes' if m['lossless'][b] else 'NO'}" for b in bs)
        lines.append(f"| {name} | {_f(m['tau'])} | {_f(draftflow_tau.get(name))} | {cells} |")
    lines += ["", "| method | " + " | ".join(f"τ vLLM {c}" for c in _categories(served)) + " |",
              "|---" * (1 + len(_categories(served))) + "|"]
    for name, m in served["methods"].items():
        lines.append(f"| {name} | " + " | ".join(_f(m["tau_per_category"].get(c)) for c in _categories(served)) + " |")
    return lines


def _categories(served: dict[str, Any]) -> list[str]:
    return sorted({c for m in served["methods"].values() for c in m["tau_per_category"]})
