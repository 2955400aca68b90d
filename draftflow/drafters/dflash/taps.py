"""What the data stages need of DFlash (light: extract's and tokenize's code fingerprints include it, so it
imports no torch, model, training or export code): its taps, the `drafter` section's target-free checks,
and the minimum supervised tokens of a sequence.

Taps: `drafter.target_layer_ids`, else the paper's spread over the target's depth (`layers.dflash_taps`).
"""

from __future__ import annotations

from draftflow.config import DrafterConfig
from draftflow.drafters.rule import DataRule
from draftflow.errors import ConfigError
from draftflow.layers import check_tap_count, dflash_taps

LAYER_TYPES = ("full_attention", "sliding_attention")


def check_layer_types(layer_types: list[str] | None, num_layers: int, sliding_window: int | None) -> None:
    """`drafter.layer_types`: one known type per layer, and a window for sliding layers (needs no target).

    Raises:
        ConfigError: one line naming the setting.
    """
    types = layer_types or []
    if layer_types is not None and len(types) != num_layers:
        raise ConfigError(f"drafter.layer_types has {len(types)} entries but drafter.num_layers is {num_layers}")
    bad = sorted(set(types) - set(LAYER_TYPES))
    if bad:
        raise ConfigError(f"drafter.layer_types has unknown {bad}; use {list(LAYER_TYPES)}")
    if "sliding_attention" in types and not (sliding_window or 0) >= 1:
        raise ConfigError("drafter.layer_types has sliding_attention layers: set drafter.sliding_window >= 1")


def _check(drafter: DrafterConfig) -> None:
    if drafter.target_layer_ids is not None:
        check_tap_count(drafter.target_layer_ids, drafter.num_taps)
    check_layer_types(drafter.layer_types, drafter.num_layers, drafter.sliding_window)


RULE = DataRule(
    kind="dflash",
    check=_check,
    taps=lambda d, n: dflash_taps(d.target_layer_ids, d.num_taps, n),
    stores_final=False,
    min_supervised=lambda d: 2 * d.block_size,  # room for anchors and blocks
)
