"""One truth for target layer ids (contract 6, docs/extending.md).

DFlash `target_layer_ids` are 0-based decoder-layer indices: id L means the
*output* of decoder layer L, which transformers returns as
`hidden_states[L + 1]` (`hidden_states[0]` is the embedding output).
EAGLE-3 taps are boundary indices into that same `hidden_states` tuple.
Every conversion between the two lives here and nowhere else.

Inside draftflow, EAGLE-3 taps use the DFlash convention too; the boundary form appears only in
exports and in vLLM's own settings. Each kind's default taps live in its folder
(`drafters/<kind>/taps.py`), checked here by `validate_layer_ids`. One special id,
`FINAL`, names the target's final *normed* hidden state (the output of `model.model.norm`,
the LM head's input): EAGLE-3 feature shards store it beside the taps so soft targets can
be computed offline.
"""

from __future__ import annotations

from draftflow.errors import ConfigError

# The one table of index conventions. Where each consumer reads DFlash id L (the output of decoder layer L):
#   hf_hook     forward hook on decoder layer L itself: its output is the id, unchanged.
#   hf_hidden   transformers `output_hidden_states` tuple: boundary index L + 1 (entry 0 is the embeddings).
#   vllm        vLLM `eagle_aux_hidden_state_layer_ids` (and the speculators configs vLLM reads,
#               `aux_hidden_state_layer_ids`): the residual stream *entering* layer k, so
#               k = num_layers is the last layer's un-normed output: L + 1.
# Every +1/-1 between these conventions in draftflow goes through `engine_layer_index` / `engine_layer_id`.
ENGINE_OFFSETS = {"hf_hook": 0, "hf_hidden": 1, "vllm": 1}


def _offset(engine: str) -> int:
    if engine not in ENGINE_OFFSETS:
        raise ValueError(f"no layer-index convention for engine {engine!r}; known: {sorted(ENGINE_OFFSETS)}")
    return ENGINE_OFFSETS[engine]


def engine_layer_index(engine: str, layer_id: int) -> int:
    """The index `engine` uses for DFlash layer id L (see `ENGINE_OFFSETS`).

    Raises:
        ValueError: an engine without an entry in the table.
    """
    return layer_id + _offset(engine)


def engine_layer_id(engine: str, index: int) -> int:
    """The DFlash layer id that `engine`'s `index` names: the inverse of `engine_layer_index`.

    Raises:
        ValueError: an engine without an entry in the table.
    """
    return index - _offset(engine)


FINAL = -1  # feature id of the target's final normed hidden state (not a decoder layer)


def hf_hidden_state_index(layer_id: int) -> int:
    """Index into HF `output_hidden_states` for DFlash layer id L (output of layer L): `ENGINE_OFFSETS`."""
    return engine_layer_index("hf_hidden", layer_id)


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
        raise ConfigError(f"drafter.target_layer_ids must be strictly increasing, got {list(layer_ids)}")
    return list(layer_ids)
