"""One truth for target layer ids (contract 6, docs/extending.md).

DFlash `target_layer_ids` are 0-based decoder-layer indices: id L means the
*output* of decoder layer L, which transformers returns as
`hidden_states[L + 1]` (`hidden_states[0]` is the embedding output).
EAGLE-3 taps are boundary indices into that same `hidden_states` tuple.
Every conversion between the two lives here and nowhere else.

Inside draftflow, EAGLE-3 taps use the DFlash convention too (`default_eagle3_layer_ids`);
the boundary form appears only in exports and in vLLM's own settings. One special id,
`FINAL`, names the target's final *normed* hidden state (the output of `model.model.norm`,
the LM head's input): EAGLE-3 feature shards store it beside the taps so soft targets can
be computed offline.
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
