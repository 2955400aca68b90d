"""The drafter registry: one `DrafterSpec` per `drafter.kind`.

Adding a kind is one module in this package (its spec), its tap rule in `draftflow.models.taps`,
and one entry in `DRAFTERS`. Everything that used to branch on the kind (the training config, model
and objective, evaluate's proposer, exports, the plan's cost model) looks the spec up here; tap ids
are resolved by `draftflow.models.taps.feature_ids` (kept apart so extract's code stays small).
"""

from __future__ import annotations

from draftflow.drafters import dflash, eagle3
from draftflow.drafters.spec import DrafterSpec, DraftInputs
from draftflow.errors import ConfigError
from draftflow.models.taps import check_drafter, feature_ids, tap_rule

DRAFTERS: dict[str, DrafterSpec] = {s.kind: s for s in (dflash.SPEC, eagle3.SPEC)}

__all__ = ["DRAFTERS", "DraftInputs", "DrafterSpec", "check_drafter", "drafter_spec", "feature_ids",
           "spec_for_architecture"]


def drafter_spec(kind: str) -> DrafterSpec:
    """The spec of `drafter.kind`.

    Raises:
        ConfigError: an unknown kind (the message names the known ones).
    """
    tap_rule(kind)  # an unknown kind: one line naming the known ones
    return DRAFTERS[kind]


def spec_for_architecture(architecture: str | None) -> DrafterSpec:
    """The spec whose checkpoints record `architecture` in config.json (a DFlash one when it is absent)."""
    for spec in DRAFTERS.values():
        if spec.architecture == (architecture or "DFlashDrafter"):
            return spec
    known = sorted(s.architecture for s in DRAFTERS.values())
    raise ConfigError(f"checkpoint architecture {architecture!r} is not a draftflow drafter; known: {known}")
