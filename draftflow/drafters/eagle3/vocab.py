"""EAGLE-3's draft vocabulary: the tokens its LM head scores, chosen by training from the supervised
token counts of the tokenize stage (so `drafter.draft_vocab_size` is a train setting, never extract's).
"""

from __future__ import annotations

from collections import Counter

import torch


def draft_vocab(freq: Counter, vocab_size: int, n: int) -> tuple[list[int], list[bool]]:
    """EAGLE-3 draft vocabulary: the top-n supervised tokens (ties by id), in id order.

    Returns:
        d2t (n,) with `used[i] = i + d2t[i]`, and t2d (vocab_size,) True for used tokens.
        When fewer than n tokens were seen, the lowest unused ids fill the rest.
    """
    n = min(n, vocab_size)
    ranked = [t for t, _ in sorted(freq.items(), key=lambda tc: (-tc[1], tc[0])) if t < vocab_size][:n]
    chosen = set(ranked)
    filler = (t for t in range(vocab_size) if t not in chosen)
    while len(chosen) < n:
        chosen.add(next(filler))
    used = sorted(chosen)
    t2d = [False] * vocab_size
    for t in used:
        t2d[t] = True
    return [t - i for i, t in enumerate(used)], t2d


def draft_ids(token_ids: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """The draft ids of the target ids `token_ids` that are in the draft vocabulary (`t2d` (vocab_size,) bool), in
    their order: a draft id counts the draft tokens before it (`i + d2t[i]` is the i-th id marked in t2d)."""
    token_ids = token_ids[token_ids < t2d.numel()]
    return (torch.cumsum(t2d.long(), 0) - 1)[token_ids[t2d[token_ids]]]
