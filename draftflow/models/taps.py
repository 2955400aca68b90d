"""The one path for a drafter kind's feature ids, and the `drafter` section's target-free checks.

Extract stores `feature_ids`, training builds its drafter config by the same rules (and checks
shards against it), evaluate reads the ids from the checkpoint, and the plan's preflight calls
`check_drafter` (no target) then `feature_ids` (the target's depth), one line per error.

Deliberately light (layers, config, the layer-type rule): the extract stage imports it, and a
stage's code fingerprint is its import closure, so nothing here may import training or exports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from draftflow.config import DrafterConfig
from draftflow.errors import ConfigError
from draftflow.layers import FINAL, check_eagle3_count, check_tap_count, dflash_taps, eagle3_taps
from draftflow.models.dflash_config import check_layer_types


@dataclass(frozen=True)
class TapRule:
    """check: target-free checks of the `drafter` section; taps: (section, target depth) -> validated
    tap ids; stores_final: feature shards also hold `FINAL` (the target's final normed state)."""

    check: Callable[[DrafterConfig], None]
    taps: Callable[[DrafterConfig, int], list[int]]
    stores_final: bool


def _dflash_check(drafter: DrafterConfig) -> None:
    if drafter.target_layer_ids is not None:
        check_tap_count(drafter.target_layer_ids, drafter.num_taps)
    check_layer_types(drafter.layer_types, drafter.num_layers, drafter.sliding_window)


def check_one_layer(drafter: DrafterConfig) -> None:
    """EAGLE-3 has exactly one decoder layer: `drafter.num_layers` unset or 1."""
    if "num_layers" in drafter.model_fields_set and drafter.num_layers != 1:
        raise ConfigError(f"drafter.kind=eagle3 has exactly one decoder layer but drafter.num_layers is "
                          f"{drafter.num_layers}; remove it or set 1")


def _eagle3_check(drafter: DrafterConfig) -> None:
    if drafter.target_layer_ids is not None:
        check_eagle3_count(drafter.target_layer_ids)
    check_one_layer(drafter)


TAP_RULES: dict[str, TapRule] = {
    "dflash": TapRule(_dflash_check, lambda d, n: dflash_taps(d.target_layer_ids, d.num_taps, n), False),
    "eagle3": TapRule(_eagle3_check, lambda d, n: eagle3_taps(d.target_layer_ids, n), True),
}


def tap_rule(kind: str) -> TapRule:
    """The tap rule of `drafter.kind`.

    Raises:
        ConfigError: an unknown kind (the message names the known ones).
    """
    if kind not in TAP_RULES:
        raise ConfigError(f"drafter.kind={kind!r} is not a drafter kind; known: {', '.join(sorted(TAP_RULES))}")
    return TAP_RULES[kind]


def check_drafter(drafter: DrafterConfig) -> TapRule:
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
