"""Training-free baseline proposers, decoded by the same loop as the trained drafter.

A baseline answers "what does the trained drafter buy over drafting nothing, or over copying?":

- `NoDraft` proposes nothing, so each step is one plain target step and τ = 1 by construction
  (measured anyway, by the very loop that measures the drafter).
- `PromptLookup` is n-gram / prompt-lookup drafting: the continuation of the most recent earlier
  occurrence of the last n tokens of prompt + output, n from `max_ngram` down to `min_ngram`, at
  most as many drafts as the trained drafter may propose per step. The idea is prompt lookup
  decoding (A. Saxena, 2023, github.com/apoorvumang/prompt-lookup-decoding) and LLMA's copying of
  reference spans (N. Yang et al., "Inference with Reference: Lossless Acceleration of Large
  Language Models", arXiv 2304.04487, 2023); this code is written here.

Both plug into `draftflow.evaluation.decode.propose` (a `Baseline` proposes by itself instead of
through a `DrafterSpec`), so verification, acceptance and the lossless check are the drafter's own.
What they do not know: the target's features (they read tokens only), stores, reports.

Key trade-off: the lookup is a plain backwards scan, O(T * n) per step in Python; at evaluation
lengths (a few thousand tokens) that is far below one target forward, and it needs no index to
keep in step with rejected drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from draftflow.errors import ConfigError

BASELINES = ("no_draft", "prompt_lookup")


@dataclass(frozen=True)
class _TapConfig:
    """What the decoding loop reads from a drafter's config: which target layers to capture."""

    target_layer_ids: list[int] = field(default_factory=lambda: [0])  # read, never used by a baseline


@dataclass(frozen=True)
class Baseline:
    """A proposer that needs no training. `max_drafts` caps the drafts per step (the drafter's own cap)."""

    name: str
    max_drafts: int
    config: _TapConfig = field(default_factory=_TapConfig)

    def propose(self, seq: list[int], anchor: int, ctx: Any = None) -> list[int]:
        """Drafts for the positions after `anchor` (`ctx`, the target's features, is ignored)."""
        return []

    def eval(self) -> Baseline:  # the decoding loops call `drafter.eval()`; nothing to switch here
        return self


@dataclass(frozen=True)
class NoDraft(Baseline):
    """Proposes nothing: every step keeps exactly the target's own next token (τ = 1)."""


@dataclass(frozen=True)
class PromptLookup(Baseline):
    """Copies the continuation of the latest earlier match of the last n tokens (n = max_ngram .. min_ngram)."""

    max_ngram: int = 3
    min_ngram: int = 1

    def propose(self, seq: list[int], anchor: int, ctx: Any = None) -> list[int]:
        return lookup(seq + [anchor], self.max_drafts, self.max_ngram, self.min_ngram)


def lookup(tokens: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the last n tokens.

    Args:
        tokens: prompt and output so far (the last one is the anchor the drafts follow).
        k: most drafts to return.
        max_ngram, min_ngram: n is tried from the longest down; the first n with a match wins.

    Returns:
        The continuation (shorter than k when the match sits near the end, empty when nothing matches).
    """
    if k <= 0:
        return []
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest occurrence first, never the suffix itself
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def make_baselines(names: list[str], max_drafts: int) -> list[Baseline]:
    """The configured baselines (`evaluate.baselines`), each allowed `max_drafts` drafts per step.

    Raises:
        ConfigError: an unknown name (the config's Literal catches it first; this guards library callers).
    """
    kinds = {"no_draft": NoDraft, "prompt_lookup": PromptLookup}
    unknown = [n for n in names if n not in kinds]
    if unknown:
        raise ConfigError(f"evaluate.baselines: unknown baseline {unknown[0]!r}; known: {list(BASELINES)}")
    return [kinds[n](name=n, max_drafts=max_drafts) for n in names]
