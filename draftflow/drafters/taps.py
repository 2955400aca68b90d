"""The light registry of drafter kinds (each kind's `DataRule`): the one path for a kind's feature ids,
its minimum supervised tokens, and the `drafter` section's target-free checks.

Extract stores `feature_ids`, training builds its drafter config by the same rules (and checks
shards against it), evaluate reads the ids from the checkpoint, and the plan's preflight calls
`check_drafter` (no target) then `feature_ids` (the target's depth), one line per error.

Deliberately light (each kind's `taps.py`: config, layers, errors): the tokenize and extract stages
import it, and a stage's code fingerprint is its import closure, so nothing here may import torch,
models, training or exports. Trade-off: the kinds' modules are imported by name (one list, `KINDS`, for
this light registry and the full one), which `draftflow.codehash` is told of (`COMPUTED`) rather than
reading it from import statements.
"""

from __future__ import annotations

import importlib

from draftflow.config import DrafterConfig
from draftflow.drafters.rule import DataRule
from draftflow.errors import ConfigError
from draftflow.layers import FINAL

# The drafter kinds: one entry per kind, the name of its folder `draftflow/drafters/<kind>/` (the list every
# part of draftflow reads: `draftflow.drafters.registry` loads each one's spec).
KINDS = ("dflash", "eagle3")


def _rule(kind: str) -> DataRule:
    """`draftflow/drafters/<kind>/taps.py`'s `RULE`. Imported by name, so `draftflow.codehash.COMPUTED` names
    every kind's taps.py as part of this module's code (a stage's fingerprint still covers them)."""
    rule = importlib.import_module(f"draftflow.drafters.{kind}.taps").RULE
    if rule.kind != kind:
        raise ConfigError(f"draftflow/drafters/{kind}/taps.py: RULE.kind is {rule.kind!r}; set it to {kind!r}")
    return rule


TAP_RULES: dict[str, DataRule] = {k: _rule(k) for k in KINDS}


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
    for option in ("distill_top_k", "acceptance_loss"):
        if getattr(drafter, option) and option not in rule.objective_options:
            raise ConfigError(f"drafter.{option}={getattr(drafter, option)!r}: drafter.kind={drafter.kind} does not "
                              f"train with it (its objective takes {', '.join(rule.objective_options) or 'none'}); "
                              "unset it")
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
    return rule.taps(drafter, num_target_layers) + ([FINAL] if stores_final(drafter) else [])


def stores_final(drafter: DrafterConfig) -> bool:
    """Whether features hold the target's final normed state: kinds that read it (EAGLE-3), and any kind
    with soft labels (`drafter.distill_top_k`: the target's distribution is computed from it)."""
    return tap_rule(drafter.kind).stores_final or bool(drafter.distill_top_k)


def final_state_input(drafter: DrafterConfig) -> dict[str, str]:
    """Extract's fingerprint input for a final state a kind stores only for soft labels ({} otherwise): changing
    `distill_top_k` from one k to another re-runs training only, turning soft labels on re-runs extract."""
    return {"final_state": "stored"} if stores_final(drafter) and not tap_rule(drafter.kind).stores_final else {}


def min_supervised_tokens(drafter: DrafterConfig, configured: int | None = None) -> int:
    """The fewest supervised tokens a training sequence keeps: `configured` (`tokenize.min_supervised_tokens`),
    else what `drafter.kind` needs (its `DataRule.min_supervised`)."""
    return configured or tap_rule(drafter.kind).min_supervised(drafter)
