"""The drafter registry: one `DrafterSpec` per `drafter.kind`, and the lookups.

A kind is one folder, `draftflow/drafters/<kind>/`, and one entry in `draftflow.drafters.taps.KINDS` (see
docs/extending.md, "Adding a drafter kind"): its light data rule is loaded there (tokenize and extract read
it without importing models), its full spec here (`<kind>/spec.py`'s `SPEC`). Everything that used to
branch on the kind (the training config, model and objective, evaluate's proposer, exports, serving, the
plan's cost model) asks the spec.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from draftflow.drafters.spec import DrafterSpec, DraftInputs
from draftflow.drafters.taps import KINDS, TAP_RULES, check_drafter, feature_ids, tap_rule
from draftflow.errors import ConfigError, StoreError
from draftflow.models.weights import CONFIG_NAME


def _spec(kind: str) -> DrafterSpec:
    """`draftflow/drafters/<kind>/spec.py`'s `SPEC` (imported by name: `draftflow.codehash.COMPUTED`), checked
    against the kind's folder name and data rule."""
    spec = importlib.import_module(f"draftflow.drafters.{kind}.spec").SPEC
    if spec.kind != kind or spec.rule is not TAP_RULES[kind]:
        raise ConfigError(f"draftflow/drafters/{kind}/spec.py: SPEC needs kind={kind!r} and rule=the RULE of "
                          f"draftflow/drafters/{kind}/taps.py")
    return spec


DRAFTERS: dict[str, DrafterSpec] = {k: _spec(k) for k in KINDS}
# Checkpoints written before kinds recorded their architecture are DFlash ones.
UNRECORDED_ARCHITECTURE = "DFlashDrafter"

__all__ = ["DRAFTERS", "DraftInputs", "DrafterSpec", "check_drafter", "drafter_spec", "feature_ids",
           "load_exported", "spec_for_architecture", "spec_for_export"]


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
        if spec.architecture == (architecture or UNRECORDED_ARCHITECTURE):
            return spec
    known = sorted(s.architecture for s in DRAFTERS.values())
    raise ConfigError(f"checkpoint architecture {architecture!r} is not a draftflow drafter; known: {known}")


def spec_for_export(config: dict[str, Any]) -> DrafterSpec:
    """The spec of the kind that wrote an export's `config.json` (either format).

    Raises:
        StoreError: no kind claims it.
    """
    for spec in DRAFTERS.values():
        if spec.owns_export(config):
            return spec
    archs = config.get("architectures") or []
    raise StoreError(f"config with architectures {archs} is not a draftflow export; re-export the drafter")


def load_exported(export_dir: str | Path, target_model: Any) -> Any:
    """Load an exported folder (any kind, either format) back around `target_model` (round-trip check).

    Raises:
        StoreError: missing files, no kind claims it, or weights that do not match the config exactly.
    """
    folder = Path(export_dir)
    data = json.loads((folder / CONFIG_NAME).read_text())
    return spec_for_export(data).load_export(folder, data, target_model)
