"""What the data stages need of EAGLE-3 (light, as `draftflow/drafters/dflash/taps.py`): three taps, low /
mid / high (`eagle3_taps`), the target's final normed state stored beside them (soft targets), one
decoder layer, and the minimum supervised tokens of a sequence.
"""

from __future__ import annotations

from draftflow.config import DrafterConfig
from draftflow.drafters.rule import DataRule
from draftflow.errors import ConfigError
from draftflow.layers import engine_layer_id, validate_layer_ids


def eagle3_layer_ids(num_target_layers: int) -> list[int]:
    """EAGLE-3 low/mid/high boundary indices: 2, N // 2, N - 3.

    vLLM's default `eagle_aux_hidden_state_layer_ids` (the residual stream *entering*
    those layers), the same layers SpecForge reads as `hidden_states[1 + 1]`,
    `hidden_states[N // 2 - 1 + 1]`, `hidden_states[N - 4 + 1]`.
    """
    return [2, num_target_layers // 2, num_target_layers - 3]


def default_eagle3_layer_ids(num_target_layers: int) -> list[int]:
    """EAGLE-3's default taps as draftflow (DFlash-convention) ids: 1, N // 2 - 1, N - 4.

    `eagle3_layer_ids` read back through the vLLM row of `ENGINE_OFFSETS` (boundary index k =
    output of layer k - 1).
    """
    return [engine_layer_id("vllm", b) for b in eagle3_layer_ids(num_target_layers)]


def eagle3_taps(layer_ids: list[int] | None, num_target_layers: int) -> list[int]:
    """EAGLE-3's three taps (draftflow ids): the given ones, else the default; validated.

    Raises:
        ConfigError: not exactly three ids, or ids `validate_layer_ids` refuses (a target
            shallower than 7 layers makes the default ids collide: set them explicitly).
    """
    ids = list(layer_ids) if layer_ids is not None else default_eagle3_layer_ids(num_target_layers)
    check_eagle3_count(ids)
    return validate_layer_ids(ids, num_target_layers)


def check_eagle3_count(layer_ids: list[int]) -> None:
    """EAGLE-3 fuses exactly three taps (target-free, so preflight checks it first)."""
    if len(layer_ids) != 3:
        raise ConfigError(
            f"drafter.kind=eagle3 fuses exactly 3 taps (low, mid, high), but drafter.target_layer_ids "
            f"has {len(layer_ids)}: {list(layer_ids)}; give 3 ids or leave it null"
        )


def _check(drafter: DrafterConfig) -> None:
    if drafter.target_layer_ids is not None:
        check_eagle3_count(drafter.target_layer_ids)
    if drafter.distill_top_k and drafter.distill_top_k > drafter.draft_vocab_size:
        raise ConfigError(f"drafter.distill_top_k={drafter.distill_top_k} is more than EAGLE-3 scores: its soft "
                          f"labels come from the draft vocabulary (drafter.draft_vocab_size={drafter.draft_vocab_size})"
                          "; lower distill_top_k or unset it for the whole distribution")


RULE = DataRule(
    kind="eagle3",
    check=_check,
    taps=lambda d, n: eagle3_taps(d.target_layer_ids, n),
    stores_final=True,
    # A chain of ttt_steps drafts from one anchor, twice over (as DFlash's 2 x block_size: 16 for 7 steps).
    min_supervised=lambda d: 2 * (d.ttt_steps + 1),
)
