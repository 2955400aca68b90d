"""The light registry of drafter kinds (each kind's `DataRule`): the one path for a kind's feature ids,
its minimum supervised tokens, and the `drafter` section's target-free checks.

Extract stores `feature_ids`, training builds its drafter config by the same rules (and checks
shards against it), evaluate reads the ids from the checkpoint, and the plan's preflight calls
`check_drafter` (no target) then `feature_ids` (the target's depth), one line per error.

Deliberately light (each kind's `taps.py`: config, layers, errors): the tokenize and extract stages
import it, and a stage's code fingerprint is its import closure, so nothing here may import torch,
models, training or exports. Trade-off: a kind is listed twice, here and in `drafters/registry.py`
(its full spec); the registry refuses to load when the two lists differ.
"""

from __future__ import annotations

from draftflow.config import DrafterConfig
from draftflow.drafters.dflash import taps as dflash_rule
from draftflow.drafters.eagle3 import taps as eagle3_rule
from draftflow.drafters.rule import DataRule
from draftflow.errors import ConfigError
from draftflow.layers import FINAL

# One line per kind (its light rule); `draftflow.drafters.registry` lists the same kinds' full specs.
TAP_RULES: dict[str, DataRule] = {r.kind: r for r in (dflash_rule.RULE, eagle3_rule.RULE)}


def tap_rule(kind: str) -> DataRule:
    """The tap rule of `drafter.kind`.

    Raises:
        ConfigError: an unknown kind (the message names the known ones).
    """
    if kind not in TAP_RULES:
        raise ConfigError(f"drafter.kind={kind!r} is not a drafter kind; known: {', '.join(sorted(TAP_RULES))}")
    return TAP_RULES[kind]


def check_drafter(drafter: DrafterConfig) -> DataRule:
    """The `drafter` section's target-free checks (kind, tap count, layer types, …); returns its tap rule."""
    rule = tap_rule(drafter.kind)
    rule.check(drafter)
    return rule


def feature_ids(drafter: DrafterConfig, num_target_layers: int) -> list[int]:
    """The feature ids extract stores and training and evaluation read, in order: the kind's taps
    (configured or default), validated against the target's depth, then `FINAL` for kinds that
    store the target's final normed state.

    Raises:
        ConfigError: one line naming the setting (count, range, order, kind).
    """
    rule = check_drafter(drafter)
    return rule.taps(drafter, num_target_layers) + ([FINAL] if rule.stores_final else [])


def min_supervised_tokens(drafter: DrafterConfig, configured: int | None = None) -> int:
    """The fewest supervised tokens a training sequence keeps: `configured` (`tokenize.min_supervised_tokens`),
    else what `drafter.kind` needs (its `DataRule.min_supervised`)."""
    return configured or tap_rule(drafter.kind).min_supervised(drafter)
