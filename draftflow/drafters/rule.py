"""`DataRule`: what the data stages (tokenize, extract) and the plan's preflight need of a drafter kind.

Kept apart from `DrafterSpec` (models, objectives, exports) because a stage's code fingerprint is its
import closure: tokenize and extract import every kind's rule, so a rule imports only config, layers and
errors, and an edit to a kind's model or trainer never recomputes their terabytes of output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from draftflow.config import DrafterConfig


@dataclass(frozen=True)
class DataRule:
    """One kind's data rule.

    Attributes:
        kind: the `drafter.kind` value.
        check: target-free checks of the `drafter` section (one-line ConfigErrors).
        taps: (section, target depth) -> validated tap ids.
        stores_final: feature shards also hold `layers.FINAL` (the target's final normed state).
        min_supervised: (section) -> the fewest supervised tokens a training sequence needs (tokenize drops
            shorter ones; `tokenize.min_supervised_tokens` overrides it).
        objective_options: the objective options of the `drafter` section its objective implements; another one
            set (truthy) is a one-line error at preflight.
    """

    kind: str
    check: Callable[[DrafterConfig], None]
    taps: Callable[[DrafterConfig, int], list[int]]
    stores_final: bool
    min_supervised: Callable[[DrafterConfig], int]
    objective_options: tuple[str, ...] = ("distill_top_k", "acceptance_loss")  # the `drafter` options it trains by
