"""Prompt categories and baselines: which eval prompts are decoded, and the statistics per category and per proposer.

Categories come from curation (`SourceConfig.category` / `category_field`, kept in curate's
`category` column); a row without one counts under its source's name. `selection.select` picks
the prompts (`evaluate.categories`, then `evaluate.num_prompts` taken round-robin over the
categories so each keeps a share), `split_stats` cuts one run's per-step acceptance lengths by category, and
`run_baselines` decodes the very same prompts with the training-free proposers of
`draftflow.evaluation.baselines` through the drafter's loop (KV-cached unless `evaluate.kv_cache`
is false), checked against the drafter's (lossless) outputs.

What it does not know: stores, manifests, report text. Trade-off: each drafting baseline costs one speculative
decode per prompt (its rounds; checked against the drafter's outputs, so no greedy decode); no_draft costs
nothing (its figures follow from those outputs: τ 1); the speedup timings add a few dozen forwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from draftflow import progress
from draftflow.config import EvaluateConfig
from draftflow.drafters.registry import spec_for_architecture
from draftflow.evaluation import speedup
from draftflow.evaluation.baselines import Baseline, NoDraft, make_baselines
from draftflow.evaluation.cached import speculative_generate_cached
from draftflow.evaluation.decode import (
    RoundFn,
    acceptance_stats,
    capture_taps,
    check_lossless,
    drafts_per_step,
    propose,
    speculative_generate,
)
from draftflow.evaluation.selection import row_category, select

__all__ = ["add_comparisons", "proposer_taus", "row_category", "run_baselines", "select", "split_stats", "with_counts"]


def with_counts(lengths: list[list[int]], outputs: list[list[int]], width: int) -> dict[str, Any]:
    """`acceptance_stats` over several prompts' per-step lengths, plus tokens and prompts."""
    flat = [n for acc in lengths for n in acc]
    return acceptance_stats(flat, width) | {"tokens": sum(len(o) for o in outputs), "prompts": len(outputs)}


def split_stats(
    lengths: list[list[int]], outputs: list[list[int]], categories: Sequence[str], width: int
) -> dict[str, dict[str, Any]]:
    """Per category (sorted by name): tau, acceptance_rate, accept_histogram, steps, tokens, prompts.

    Steps, tokens, prompts and histogram counts of the categories add up to those of the whole set.

    Args:
        lengths: per prompt, its acceptance length per step; outputs: per prompt, its tokens.
        categories: per prompt, its category. width: drafts per step + 1 (histogram size - 1).
    """
    out = {}
    for name in sorted(set(categories)):
        mine = [i for i, c in enumerate(categories) if c == name]
        out[name] = with_counts([lengths[i] for i in mine], [outputs[i] for i in mine], width)
    return out


def run_baselines(
    target,
    baselines: list[Baseline],
    prompts: list[list[int]],
    reference: list[list[int]],
    max_new_tokens: int,
    eos_ids: set[int],
    categories: Sequence[str],
    generate: Callable[..., tuple[list[int], list[int]]] = speculative_generate,
) -> dict[str, dict[str, Any]]:
    """Decode `prompts` with each baseline; per baseline the overall stats and its `categories` split.

    `no_draft` is not decoded again: its output is `reference` and every step after the prefill's token
    yields one token (what the loop gives it: tests/test_eval_compare.py checks).

    Args:
        reference: the target's greedy output per prompt (the drafter's checked outputs): every
            baseline must reproduce it exactly.
        categories: per prompt, its category.
        generate: the decoding loop (`decode.speculative_generate`, the reference, or the KV-cached
            `cached.speculative_generate_cached`; both take a `Baseline` as their drafter).

    Raises:
        LosslessError: a baseline's output differs from `reference` (the loop would be wrong).
    """
    report: dict[str, dict[str, Any]] = {}
    decodes, done = sum(not isinstance(b, NoDraft) for b in baselines) * len(prompts), 0
    for base in baselines:
        if isinstance(base, NoDraft):  # greedy itself: one token a step after the prefill's, nothing to decode
            lengths, outputs = [[1] * max(len(ref) - 1, 0) for ref in reference], list(reference)
        else:
            lengths, outputs = [], []
            for i, prompt in enumerate(prompts):
                tokens, acc = generate(target, base, prompt, max_new_tokens, eos_ids)
                check_lossless(i, tokens, reference[i])
                lengths.append(acc)
                outputs.append(tokens)
                done += 1
                progress.within("evaluate", done, decodes, "baseline decodes")
        width = base.max_drafts + 1
        report[base.name] = with_counts(lengths, outputs, width) | {
            "categories": split_stats(lengths, outputs, categories, width)
        }
    return report


def proposer_taus(stats: dict[str, Any], drafter: str = "drafter") -> dict[str, float | None]:
    """τ per proposer of an evaluation: the drafter's (under the name `drafter`), then each baseline's."""
    return {drafter: stats["tau"]} | {name: b["tau"] for name, b in (stats.get("baselines") or {}).items()}


def add_comparisons(
    target,
    drafter,
    stats: dict[str, Any],
    prompts: list[list[int]],
    categories: Sequence[str],
    ecfg: EvaluateConfig,
    eos_ids: set[int],
    round_features: RoundFn | None = None,
) -> None:
    """Add `categories`, `baselines` and `speedup` to an `evaluate_prompts` result (in place).

    Takes out its `accept_lengths`; reads its `outputs` (left in place) as the greedy reference.

    Args:
        prompts, categories: the prompts `stats` was measured on and their categories (same order).
    """
    lengths, outputs = stats.pop("accept_lengths"), stats["outputs"]
    prompts, categories = prompts[: len(outputs)], list(categories[: len(outputs)])
    width = drafts_per_step(drafter) + 1
    stats["categories"] = split_stats(lengths, outputs, categories, width)
    bases = make_baselines(ecfg.baselines, width - 1)
    loop = speculative_generate_cached if ecfg.kv_cache else speculative_generate  # the drafter's loop
    stats["baselines"] = run_baselines(target, bases, prompts, outputs, ecfg.max_new_tokens, eos_ids, categories, loop)
    if not outputs:
        return
    context = prompts[0] + outputs[0]  # the first prompt and its answer: a typical decoding position
    seq, anchor = context[:-1], context[-1]
    _, ctx = capture_taps(target, seq, drafter.config.target_layer_ids, round_features)
    calls = {"drafter": lambda: propose(drafter, seq, anchor, ctx)}
    calls |= {b.name: (lambda b=b: b.propose(seq, anchor)) for b in bases if not isinstance(b, NoDraft)}
    kind = spec_for_architecture(drafter.config.architecture).kind
    candidates = [speedup.Candidate("drafter", kind, stats["acceptance_rate"], speedup.DRAFTING.get(kind, "chain"))]
    candidates += [speedup.Candidate(n, n, b["acceptance_rate"], speedup.DRAFTING.get(n, "chain"))
                   for n, b in stats["baselines"].items() if n in calls and b["tau"] is not None]
    stats["speedup"] = speedup.speedups(speedup.measure(target, calls, seq, anchor, width), candidates)
