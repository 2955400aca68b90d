"""What the data stages need of DFlash (light: extract's and tokenize's code fingerprints include it, so it
imports no torch, model, training or export code): its taps, the `drafter` section's target-free checks,
and the minimum supervised tokens of a sequence.

Taps: `drafter.target_layer_ids`, else the paper's spread over the target's depth (`dflash_taps`).
"""

from __future__ import annotations

from draftflow.config import DrafterConfig
from draftflow.drafters.rule import DataRule
from draftflow.errors import ConfigError
from draftflow.layers import validate_layer_ids

LAYER_TYPES = ("full_attention", "sliding_attention")


def default_dflash_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """Taps spread over the target as in the DFlash paper (arXiv 2602.06036).

    `round(1 + i * (N - 4) / (n - 1))` for i in 0..n-1; Qwen3-8B (N=36, n=5)
    gives [1, 9, 17, 25, 33].
    """
    if num_taps < 1:
        raise ConfigError(f"drafter.num_taps must be >= 1, got {num_taps}")
    if num_taps == 1:
        return [num_target_layers // 2]
    if num_target_layers < 5:
        raise ConfigError(
            f"target has {num_target_layers} layers; DFlash default taps need at least 5 "
            "(set drafter.target_layer_ids explicitly)"
        )
    span = num_target_layers - 4
    if num_taps > span + 1:  # the default ids spread over 1..N-3: more taps than that would repeat ids
        raise ConfigError(f"drafter.num_taps is {num_taps} but the target's {num_target_layers} layers give at most "
                          f"{span + 1} default taps (ids 1..{span + 1}); lower drafter.num_taps or set "
                          "drafter.target_layer_ids")
    # Python's round() is banker's rounding; the formula means round-half-up.
    return [int(1 + i * span / (num_taps - 1) + 0.5) for i in range(num_taps)]


def check_tap_count(layer_ids: list[int], num_taps: int) -> None:
    """DFlash: explicit taps must number `drafter.num_taps` (target-free, so preflight checks it first)."""
    if len(layer_ids) != num_taps:
        raise ConfigError(
            f"drafter.target_layer_ids has {len(layer_ids)} ids but drafter.num_taps is {num_taps}; make them agree"
        )


def dflash_taps(layer_ids: list[int] | None, num_taps: int, num_target_layers: int) -> list[int]:
    """DFlash's taps: the given ids, else the paper's default; validated against the target, then counted.

    Raises:
        ConfigError: ids `validate_layer_ids` refuses, or not `num_taps` of them.
    """
    ids = list(layer_ids) if layer_ids is not None else default_dflash_layer_ids(num_target_layers, num_taps)
    validate_layer_ids(ids, num_target_layers)
    check_tap_count(ids, num_taps)
    return ids


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
