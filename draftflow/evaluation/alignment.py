"""Label alignment of a DFlash drafter: does slot k predict token a+k, or a neighbour?

A drafter trained with labels shifted by one (slot k learning token a+k+1, a known peer bug)
still accepts tokens on repetitive text, where a token often equals its neighbour, so its
tau can look plausible and even beat an untrained drafter. This check separates it from a
correct one on the same data: run the drafter on teacher-forced blocks (the training layout,
the kind's `slot_drafts`, DFlash's `make_block_batch`) at every anchor of known sequences, and count,
only at positions where the tokens at a+k-1, a+k and a+k+1 all differ, how often slot k's
greedy draft equals each of them. A correctly trained drafter matches offset 0 most;
one trained on shifted labels matches offset +1 most.

What it does not know: where the sequences come from (the target's own greedy continuations
are the natural input), EAGLE-3 drafters (their chain has no slots), reports or gates.

Key trade-off: teacher forcing measures what each slot learned, independently of how many
drafts decoding accepts, at the price of one extra target forward per sequence; anchors are
batched `chunk` at a time so the (Q, T+Q) mask stays small for long sequences.
"""

from __future__ import annotations

import torch

from draftflow import progress
from draftflow.drafters.registry import spec_for_architecture
from draftflow.evaluation.decode import RoundFn, capture_taps
from draftflow.features import FeatureSample

OFFSETS = (-1, 0, 1)
# A winning offset counts as evidence only with this many hits at this rate: a barely trained drafter
# (demo tests: 24 steps, tau 1.0) matched 2 of 62 positions at +1 and none at 0, which says nothing.
MIN_RATE, MIN_HITS = 0.1, 10


@torch.no_grad()
def slot_alignment(
    target,
    drafter,
    sequences: list[tuple[list[int], list[int]]],
    round_features: RoundFn | None = None,
    chunk: int = 64,
) -> dict:
    """How often slot k drafts the token at a+k+offset, for offset -1, 0, +1.

    Args:
        target: the HF causal LM the drafter was trained for (gives the tap features).
        drafter: a drafter whose kind has `slot_drafts` (DFlash).
        sequences: (prompt ids, continuation ids) pairs; anchors are continuation positions
            whose whole block fits in the sequence.
        round_features: the feature store's rounding (see `capture_taps`).
        chunk: anchors per drafter forward.

    Returns:
        {"positions": n, "match": {offset: rate}, "offset": the offset with the highest rate, or
        None when none is strictly highest (no qualifying position, or a tie)}. A position
        qualifies when its token and its two neighbours all differ, so no two offsets can
        agree there.
    """
    B, hits, n = drafter.config.block_size, dict.fromkeys(OFFSETS, 0), 0
    kind = spec_for_architecture(drafter.config.architecture)
    drafter.eval()
    for i, (prompt, continuation) in enumerate(sequences):
        progress.within("evaluate", i, len(sequences), "prompts")
        ids = list(prompt) + list(continuation)
        T, first = len(ids), max(len(prompt), 1)
        if T - B + 1 <= first:  # no whole block after the prompt (a short answer): nothing to count
            continue
        anchors = torch.arange(first, T - B + 1)
        _, feats = capture_taps(target, ids, drafter.config.target_layer_ids, round_features)
        sample = FeatureSample(
            "alignment",
            torch.tensor(ids),
            torch.ones(T, dtype=torch.bool),
            feats.reshape(T, len(drafter.config.target_layer_ids), -1).cpu(),
        )
        tok = sample.input_ids
        for part in anchors.split(chunk):
            pos, draft = kind.slot_drafts(drafter, sample, part)  # (Q,) position of every slot, its draft
            slot = torch.arange(pos.numel()) % B
            ok = (slot >= 1) & (pos + 1 < T)
            p = pos[ok]
            # a-b-a text would let offsets -1 and +1 agree: all three tokens must differ
            distinct = (tok[p] != tok[p - 1]) & (tok[p] != tok[p + 1]) & (tok[p - 1] != tok[p + 1])
            p, d = p[distinct], draft[ok][distinct]
            n += p.numel()
            for off in OFFSETS:
                hits[off] += int((d == tok[p + off]).sum())
    match = {off: hits[off] / n if n else 0.0 for off in OFFSETS}
    best = sorted(OFFSETS, key=match.get)
    unique = match[best[-1]] > match[best[-2]]  # no position, or a tie at the top: no offset stands out
    return {"positions": n, "match": match, "offset": best[-1] if unique else None}


def alignment_report(
    target, drafter, prompts: list[list[int]], outputs: list[list[int]], round_features: RoundFn | None = None
) -> dict | None:
    """`slot_alignment` on the evaluation's own data, as report.json's `alignment`; None for a kind without slots.

    The sequences are the eval prompts with the target's greedy outputs the evaluation just decoded and
    checked: the target's own continuations, which is what regenerate trains on. Costs one target forward
    per prompt plus one drafter forward per `chunk` anchors.

    Returns:
        {"offset", "positions", "match": {"-1", "0", "+1": rate}, "conclusive", "warning": a line or None}:
        conclusive when the winner matched at least MIN_RATE of the positions and MIN_HITS tokens; the warning
        is set when another offset than 0 wins conclusively (a heuristic: logged and reported, never a failure).
    """
    if spec_for_architecture(drafter.config.architecture).slot_drafts is None:
        return None
    found = slot_alignment(target, drafter, list(zip(prompts, outputs, strict=True)), round_features)
    off, n = found["offset"], found["positions"]
    conclusive = off is not None and found["match"][off] >= MIN_RATE and found["match"][off] * n >= MIN_HITS
    warning = None
    if off not in (0, None) and conclusive:
        warning = f"labels look shifted by {off:+d}: check the objective (slot k should predict token anchor+k)"
    return {
        "offset": off,
        "positions": found["positions"],
        "warning": warning,
        "conclusive": conclusive,
        "match": {f"{o:+d}" if o else "0": rate for o, rate in found["match"].items()},
    }


def alignment_line(alignment: dict | None) -> str | None:
    """The report.md line of `alignment_report`'s result (None when there is none)."""
    if not alignment:
        return None
    rates = ", ".join(f"offset {o} {r:.3f}" for o, r in alignment["match"].items())
    best = "none stands out" if alignment["offset"] is None else f"{alignment['offset']:+d}".replace("+0", "0")
    if alignment["offset"] is not None and not alignment.get("conclusive", True):
        best += f", inconclusive: under {MIN_RATE:.0%} or {MIN_HITS} matches"
    line = (
        f"- slot alignment (DFlash, teacher-forced on the decoded outputs, {alignment['positions']} positions): "
        f"best offset **{best}** ({rates})"
    )
    return line + (f" — **warning: {alignment['warning']}**" if alignment.get("warning") else "")
