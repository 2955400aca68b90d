"""The drafter registry: one `DrafterSpec` per `drafter.kind`, and the one path that resolves taps.

Adding a kind is one module here (its spec) plus one entry in `DRAFTERS`. Everything that used
to branch on the kind (extract's feature ids, the training config/model/objective, evaluate's
proposer, exports, the plan's cost model) looks the spec up here.

`feature_ids` is the only place tap ids are resolved and validated against the target: extract
stores them, training checks shards against the drafter config built by the same rule, and
the plan (preflight, sizes, space) calls it too.
"""

from __future__ import annotations

from draftflow.config import DrafterConfig
from draftflow.drafters import dflash, eagle3
from draftflow.drafters.spec import DrafterSpec, DraftInputs
from draftflow.errors import ConfigError
from draftflow.layers import FINAL

DRAFTERS: dict[str, DrafterSpec] = {s.kind: s for s in (dflash.SPEC, eagle3.SPEC)}

__all__ = ["DRAFTERS", "DraftInputs", "DrafterSpec", "check_drafter", "drafter_spec", "feature_ids",
           "spec_for_architecture"]


def drafter_spec(kind: str) -> DrafterSpec:
    """The spec of `drafter.kind`.

    Raises:
        ConfigError: an unknown kind (the message names the known ones).
    """
    if kind not in DRAFTERS:
        raise ConfigError(f"drafter.kind={kind!r} is not a drafter kind; known: {', '.join(sorted(DRAFTERS))}")
    return DRAFTERS[kind]


def spec_for_architecture(architecture: str | None) -> DrafterSpec:
    """The spec whose checkpoints record `architecture` in config.json (a DFlash one when it is absent)."""
    for spec in DRAFTERS.values():
        if spec.architecture == (architecture or "DFlashDrafter"):
            return spec
    known = sorted(s.architecture for s in DRAFTERS.values())
    raise ConfigError(f"checkpoint architecture {architecture!r} is not a draftflow drafter; known: {known}")


def check_drafter(drafter: DrafterConfig) -> DrafterSpec:
    """The `drafter` section's target-free checks (kind, tap count, layer types, …); returns the spec."""
    spec = drafter_spec(drafter.kind)
    spec.check(drafter)
    return spec


def feature_ids(drafter: DrafterConfig, num_target_layers: int) -> list[int]:
    """The feature ids extract stores and training and evaluation read, in order: the kind's taps
    (configured or default), validated against the target's depth, then `FINAL` for kinds that
    store the target's final normed state.

    Raises:
        ConfigError: one line naming the setting (count, range, order, kind).
    """
    spec = check_drafter(drafter)
    return spec.taps(drafter, num_target_layers) + ([FINAL] if spec.stores_final else [])
