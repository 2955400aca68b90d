"""Where the gate's `promoted` mark lives, and which drafter of a root it names: the one place both the gate
(`draftflow.runs.gating`, which writes and removes the mark) and warm starts (`draftflow.training.warm`, which
start from the promoted drafter) read it from. Kept apart from the gate so the train stage's code hash does not
take in the gate's code (editing the gate never re-runs a stage).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from draftflow.store import Store

PROMOTED = "promoted.json"
POINTER = "promoted.json"  # <root>/promoted.json: the drafter in service, and every one promoted before it
OLD_POINTER_STAGE = "train"  # the folder of pointers written before entries named theirs (it had no other name)


def export_path(store: Store, stage: str, fp: str, *parts: str) -> str:
    """The export folder of the train stage `stage`/`fp` (or a path inside it): the one place this module names it.
    The stage's folder is its caller's to say (the registry's `maker("drafter")`, or a result's `stage`)."""
    return store.stage_path(stage, fp, "export", *parts)


def export_stage(folder: str) -> str:
    """The stage folder of an export folder `export_path` made (`<root>/<stage>/<fp>/export/<format>`)."""
    return folder.rstrip("/").split("/")[-4]


def marker_path(store: Store, stage: str, fp: str) -> str:
    """Where the `promoted` marker of the train stage `stage`/`fp`'s export lives."""
    return export_path(store, stage, fp, PROMOTED)


def promoted_export(store: Store) -> tuple[str, str] | None:
    """(train fingerprint, its vLLM-native export folder) of the drafter this root's gate promoted last (the most
    recently written marker: a gate that passes writes it again), or None when nothing is promoted. Whichever
    stage folder trained it: the pointer says which, and markers are looked for in every one."""
    current = (pointer(store) or {}).get("current")
    # Its marker gone with its export folder: deleted by hand (named, so a warm start can say so); its marker gone
    # alone: withdrawn by a later gate (the newest marker left is the one).
    if current:
        stage, fp = current.get("stage", OLD_POINTER_STAGE), current["train"]
        if store.exists(marker_path(store, stage, fp)) or not store.exists(export_path(store, stage, fp)):
            return fp, export_path(store, stage, fp, "vllm")
    markers = store.fs.glob(marker_path(store, "*", "*"))
    if not markers:
        return None
    newest = max(markers, key=lambda m: store.fs.modified(m).timestamp())
    stage, fp = newest.rstrip("/").split("/")[-4:-2]  # <root>/<stage>/<fp>/export/promoted.json
    return fp, export_path(store, stage, fp, "vllm")


def pointer(store: Store) -> dict[str, Any] | None:
    """`<root>/promoted.json`: `{"current": entry, "history": [entry, ...]}` (oldest first), or None."""
    path = store.path(POINTER)
    return store.read_json(path) if store.exists(path) else None


def record_promotion(store: Store, stage: str, fp: str, **about: Any) -> dict[str, Any]:
    """Make the drafter of train stage `stage`/`fp` the current one in the root's pointer, keeping the history.

    Args:
        about: what to keep with it (the evaluation, its tau, the target's fingerprint, the run's name).
    """
    entry = {"train": fp, "stage": stage, "export": store.url(export_path(store, stage, fp, "vllm")),
             "at": datetime.now(timezone.utc).isoformat(timespec="seconds"), **about}
    old = pointer(store) or {"history": []}
    same = old.get("current") or {}
    if same.get("train") == fp and same.get("evaluate") == about.get("evaluate"):
        return old  # the same verdict applied again (a re-run reusing the stages): no new promotion
    data = {"current": entry, "history": [*old["history"], entry]}
    store.write_json(store.path(POINTER), data)
    return data
