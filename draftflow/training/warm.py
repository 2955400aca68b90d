"""Warm starts: `train.init_from` starts training from a drafter already trained, not from scratch.

`train.init_from` names one of three things:
- an export folder (a vLLM-native or speculators export of either kind: config.json + *.safetensors);
- a run root: the drafter its gate promoted last (`<root>/train/<fp>/export/promoted.json`, the most recently
  written marker; its vLLM-native export);
- the word `promoted`: this run root's promoted drafter.

The drafter started from must be of the run's kind and shape, read the same taps and draft over the same
vocabulary; anything else is refused in one line naming the mismatch. EAGLE-3's draft vocabulary is taken from the
init drafter (new data would choose a slightly different one, and the trained head is only meaningful over its own).
The target may be a newer revision of the same architecture: the init drafter's `draftflow.json` records the
target fingerprint it was trained for, and the train manifest says when it differs (`draftflow status` shows it).

The warm start enters the train fingerprint by the content of the drafter (the sha256 of its export files), so a
newly promoted drafter re-runs training; naming it `promoted` or by its folder gives the same fingerprint.

What it does not know: the training loop (it hands over a state dict, `train_drafter(init=...)`), Prefect.
Trade-off: a run root or `promoted` resolves when the run is planned; a promotion during the run is used by the
next one.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draftflow.errors import ConfigError
from draftflow.promotion import PROMOTED, export_path, promoted_export
from draftflow.store import Store, digest, sha256_file

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
PROMOTED_WORD = "promoted"


@dataclass(frozen=True)
class InitDrafter:
    """A resolved `train.init_from`.

    Attributes:
        name: as written in the config. folder: the export folder (a local path or a URL in `store`'s filesystem).
        digest: the content of its files (what enters the train fingerprint). trained_for: the target fingerprint
        it was trained for, when its `draftflow.json` records one. train_fingerprint: the train stage it came from
        (a promoted drafter).
    """

    name: str
    folder: str
    digest: str
    trained_for: str | None = None
    train_fingerprint: str | None = None


def _is_export(store: Store, folder: str) -> bool:
    fs = store.fs
    return fs.exists(f"{folder}/config.json") and any(p.endswith(".safetensors") for p in fs.ls(folder, detail=False))


def _export_digest(store: Store, folder: str) -> str:
    files = sorted(p for p in store.fs.ls(folder, detail=False) if store.fs.isfile(p))
    return digest({Path(p).name: sha256_file(p, store.fs) for p in files})


def _trained_for(store: Store, folder: str) -> str | None:
    path = f"{folder}/draftflow.json"
    if not store.exists(path):
        return None
    try:
        return (store.read_json(path) or {}).get("target")
    except ValueError:
        return None


def resolve(root: str, name: str) -> InitDrafter:
    """The drafter `train.init_from = name` stands for (see the module docstring).

    Raises:
        ConfigError: nothing is there, or a root with no promoted drafter (one line naming it and what to do).
    """
    what = f"train.init_from={name!r}"
    store = Store(root if name == PROMOTED_WORD else str(Path(name).expanduser()) if "://" not in name else name)
    if name != PROMOTED_WORD and store.exists(store.base) and _is_export(store, store.base):
        return InitDrafter(name, store.url(store.base), _export_digest(store, store.base),
                           _trained_for(store, store.base))
    if name != PROMOTED_WORD and not store.fs.glob(export_path(store, "*", "*")):
        raise ConfigError(f"{what}: no export folder (config.json + *.safetensors) and no run root (trained drafters "
                          "under it) there; name an export folder, a run root, or 'promoted'")
    found = promoted_export(store)
    if found is None:
        raise ConfigError(f"{what}: {store.url(store.base)} has no promoted drafter (no export marked {PROMOTED}); "
                          "run it with an evaluate.gate that passes, or name an export folder")
    fp, folder = found
    if not store.exists(folder) or not _is_export(store, folder):
        raise ConfigError(f"{what}: the promoted drafter {store.url(folder)} is gone (its files were deleted); "
                          "re-run that root's pipeline, or name another drafter")
    return InitDrafter(name, store.url(folder), _export_digest(store, folder), _trained_for(store, folder), fp)


def fingerprint_input(root: str, name: str) -> dict[str, str]:
    """What the train fingerprint takes for `train.init_from`: the init drafter's content (not its name)."""
    return {"init_from": resolve(root, name).digest}


def load(init: InitDrafter, target_model) -> Any:
    """The init drafter, loaded around `target_model` (an export in a remote store is copied here first)."""
    from draftflow.drafters.registry import load_exported

    if "://" not in init.folder:
        return load_exported(init.folder, target_model)
    store = Store(init.folder)
    with tempfile.TemporaryDirectory(prefix="draftflow-init-") as tmp:
        for p in store.fs.ls(init.folder, detail=False):
            if store.fs.isfile(p):
                store.fs.get(p, str(Path(tmp) / Path(p).name))
        return load_exported(tmp, target_model)


def check_and_state(init: InitDrafter, loaded, drafter) -> dict[str, torch.Tensor]:
    """The init drafter's own weights and buffers, once they fit `drafter` (a fresh one of the run's config).

    Raises:
        ConfigError: another kind, other taps, or a weight of another name or shape (one line naming it).
    """
    what = f"train.init_from={init.name!r}"
    mine, theirs = drafter.config, loaded.config
    if mine.architecture != theirs.architecture:
        raise ConfigError(f"{what} is a {theirs.architecture} drafter, this run trains {mine.architecture}: set "
                          "drafter.kind to its kind or name a drafter of this kind")
    for key in ("target_layer_ids", "block_size", "draft_vocab_size"):
        a, b = getattr(mine, key, None), getattr(theirs, key, None)
        if a != b:
            raise ConfigError(f"{what}: its {key} is {b}, this run's is {a}; set drafter settings to match it or "
                              "train from scratch (unset train.init_from)")
    want, have = drafter.trainable_state_dict(), loaded.trainable_state_dict()
    for k in sorted(set(want) | set(have)):
        if k not in have or k not in want:
            side = "lacks" if k not in have else "has an extra"
            raise ConfigError(f"{what} {side} weight {k!r}: it has another shape (drafter.num_layers and other "
                              "drafter settings must match it); match them or unset train.init_from")
        if tuple(want[k].shape) != tuple(have[k].shape):
            raise ConfigError(f"{what}: weight {k!r} is {tuple(have[k].shape)}, this run's is {tuple(want[k].shape)} "
                              "(another hidden size, vocabulary or drafter shape); match it or unset train.init_from")
    return {k: v.detach().clone() for k, v in have.items()}


def stale_promoted(root: str, target_fingerprint: str) -> str | None:
    """One line when this root's promoted drafter was trained for another target than `target_fingerprint` (a new
    revision of the target: serve it only after a refresh trains for the new one), else None."""
    store = Store(root)
    found = promoted_export(store)
    if found is None:
        return None
    folder = found[1]
    trained_for = _trained_for(store, folder) if store.exists(folder) else None
    if not trained_for or trained_for == target_fingerprint:
        return None
    return (f"the promoted drafter ({store.url(folder)}) was trained for target {trained_for[:16]}, the target is now "
            f"{target_fingerprint[:16]}: serve it only after a run trains for this one (train.init_from=promoted "
            "warm-starts it)")


def manifest_note(init: InitDrafter, target_fingerprint: str) -> dict[str, Any]:
    """What the train manifest records of a warm start (`draftflow status` reads `target_changed`)."""
    return {"name": init.name, "digest": init.digest, "train_fingerprint": init.train_fingerprint,
            "trained_for": init.trained_for,
            "target_changed": bool(init.trained_for) and init.trained_for != target_fingerprint}
