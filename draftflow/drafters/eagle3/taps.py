"""What the data stages need of EAGLE-3 (light, as `draftflow/drafters/dflash/taps.py`): three taps, low /
mid / high (`layers.eagle3_taps`), the target's final normed state stored beside them (soft targets), one
decoder layer, and the minimum supervised tokens of a sequence.
"""

from __future__ import annotations

from draftflow.config import DrafterConfig
from draftflow.drafters.rule import DataRule
from draftflow.errors import ConfigError
from draftflow.layers import check_eagle3_count, eagle3_taps


def check_one_layer(drafter: DrafterConfig) -> None:
    """EAGLE-3 has exactly one decoder layer: `drafter.num_layers` unset or 1."""
    if "num_layers" in drafter.model_fields_set and drafter.num_layers != 1:
        raise ConfigError(f"drafter.kind=eagle3 has exactly one decoder layer but drafter.num_layers is "
                          f"{drafter.num_layers}; remove it or set 1")


def _check(drafter: DrafterConfig) -> None:
    if drafter.target_layer_ids is not None:
        check_eagle3_count(drafter.target_layer_ids)
    check_one_layer(drafter)
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
