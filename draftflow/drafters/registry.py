"""The drafter registry: one `DrafterSpec` per `drafter.kind`, and the lookups.

A kind is one folder, `draftflow/drafters/<kind>/` (see docs/extending.md, "Adding a drafter kind"); it
is listed here (its full spec) and in `draftflow.drafters.taps` (its light data rule, which tokenize and
extract read without importing models). Everything that used to branch on the kind (the training
config, model and objective, evaluate's proposer, exports, serving, the plan's cost model) asks the spec.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftflow.drafters.dflash.spec import SPEC as DFLASH
from draftflow.drafters.eagle3.spec import SPEC as EAGLE3
from draftflow.drafters.spec import DrafterSpec, DraftInputs
from draftflow.drafters.taps import TAP_RULES, check_drafter, feature_ids, tap_rule
from draftflow.errors import ConfigError, StoreError
from draftflow.models.weights import CONFIG_NAME

DRAFTERS: dict[str, DrafterSpec] = {s.kind: s for s in (DFLASH, EAGLE3)}

if set(DRAFTERS) != set(TAP_RULES) or any(s.rule is not TAP_RULES[k] for k, s in DRAFTERS.items()):
    raise ConfigError(f"drafter kinds differ between draftflow/drafters/registry.py {sorted(DRAFTERS)} and "
                      f"draftflow/drafters/taps.py {sorted(TAP_RULES)}: list each kind in both")

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
        if spec.architecture == (architecture or DFLASH.architecture):
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
