"""One truth for target layer ids (ARCHITECTURE.md contract 6).

DFlash `target_layer_ids` are 0-based decoder-layer indices: id L means the
*output* of decoder layer L, which transformers returns as
`hidden_states[L + 1]` (`hidden_states[0]` is the embedding output).
EAGLE-3 taps are boundary indices into that same `hidden_states` tuple.
Every conversion between the two lives here and nowhere else.
"""

from __future__ import annotations

from draftflow.errors import ConfigError


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
    # Python's round() is banker's rounding; the formula means round-half-up.
    return [int(1 + i * span / (num_taps - 1) + 0.5) for i in range(num_taps)]


def eagle3_layer_ids(num_target_layers: int) -> list[int]:
    """EAGLE-3 low/mid/high boundary indices: 2, N // 2, N - 3."""
    return [2, num_target_layers // 2, num_target_layers - 3]


def hf_hidden_state_index(layer_id: int) -> int:
    """Index into HF `output_hidden_states` for DFlash layer id L (output of layer L)."""
    return layer_id + 1


def validate_layer_ids(layer_ids: list[int], num_target_layers: int) -> list[int]:
    """Check DFlash layer ids against the target's depth; return them unchanged.

    The last layer (N-1) is refused: transformers returns its output only after
    the final norm (`hidden_states[N]` is `norm(output of layer N-1)`), so "the
    output of layer N-1" is not what an engine would capture there.

    Raises:
        ConfigError: an id is outside [0, N-2], repeated, or not increasing.
    """
    if not layer_ids:
        raise ConfigError("drafter.target_layer_ids is empty; give at least one layer id")
    for lid in layer_ids:
        if not 0 <= lid < num_target_layers:
            raise ConfigError(
                f"drafter.target_layer_ids contains {lid}, but the target has "
                f"{num_target_layers} decoder layers (valid ids 0..{num_target_layers - 2})"
            )
        if lid == num_target_layers - 1:
            raise ConfigError(
                f"drafter.target_layer_ids contains {lid}, the target's last layer, whose output "
                f"transformers only exposes after the final norm; use ids up to {num_target_layers - 2}"
            )
    if list(layer_ids) != sorted(set(layer_ids)):
        raise ConfigError(
            f"drafter.target_layer_ids must be strictly increasing, got {list(layer_ids)}"
        )
    return list(layer_ids)


# Where each capture engine reads DFlash id L (the output of decoder layer L):
#   hf_hook     forward hook on decoder layer L itself: its output is the id, unchanged.
#   hf_hidden   transformers `output_hidden_states` tuple: boundary index L + 1.
#   vllm        vLLM `eagle_aux_hidden_state_layer_ids`: the residual stream *entering*
#               layer k (so k = num_layers is the last layer's un-normed output): L + 1.
_ENGINE_OFFSETS = {"hf_hook": 0, "hf_hidden": 1, "vllm": 1}


def engine_layer_index(engine: str, layer_id: int) -> int:
    """The index `engine` uses for DFlash layer id L (see the table above).

    Raises:
        ValueError: an engine without an entry in the table.
    """
    if engine not in _ENGINE_OFFSETS:
        raise ValueError(f"no layer-index convention for engine {engine!r}; known: {sorted(_ENGINE_OFFSETS)}")
    return layer_id + _ENGINE_OFFSETS[engine]
