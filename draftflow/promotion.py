"""Where the gate's `promoted` mark lives, and which drafter of a root it names: the one place both the gate
(`draftflow.gating`, which writes and removes the mark) and warm starts (`draftflow.training.warm`, which start from
the promoted drafter) read it from. Kept apart from the gate so the train stage's code hash does not take in the
gate's code (editing the gate never re-runs a stage).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from draftflow.store import Store

PROMOTED = "promoted.json"
POINTER = "promoted.json"  # <root>/promoted.json: the drafter in service, and every one promoted before it


def export_path(store: Store, train_fp: str, *parts: str) -> str:
    """The export folder of train stage `train_fp` (or a path inside it): the one place this module names it."""
    return store.stage_path("train", train_fp, "export", *parts)


def marker_path(store: Store, train_fp: str) -> str:
    """Where the `promoted` marker of the train stage `train_fp`'s export lives."""
    return export_path(store, train_fp, PROMOTED)


def promoted_export(store: Store) -> tuple[str, str] | None:
    """(train fingerprint, its vLLM-native export folder) of the drafter this root's gate promoted last (the most
    recently written marker: a gate that passes writes it again), or None when nothing is promoted."""
    current = (pointer(store) or {}).get("current")
    # Its marker gone with its export folder: deleted by hand (named, so a warm start can say so); its marker gone
    # alone: withdrawn by a later gate (the newest marker left is the one).
    if current and (store.exists(marker_path(store, current["train"]))
                    or not store.exists(export_path(store, current["train"]))):
        return current["train"], export_path(store, current["train"], "vllm")
    markers = store.fs.glob(marker_path(store, "*"))
    if not markers:
        return None
    newest = max(markers, key=lambda m: store.fs.modified(m).timestamp())
    fp = newest.rstrip("/").split("/")[-3]  # <root>/train/<fp>/export/promoted.json
    return fp, export_path(store, fp, "vllm")


def pointer(store: Store) -> dict[str, Any] | None:
    """`<root>/promoted.json`: `{"current": entry, "history": [entry, ...]}` (oldest first), or None."""
    path = store.path(POINTER)
    return store.read_json(path) if store.exists(path) else None


def record_promotion(store: Store, train_fp: str, **about: Any) -> dict[str, Any]:
    """Make the drafter of train stage `train_fp` the current one in the root's pointer, keeping the history.

    Args:
        about: what to keep with it (the evaluation, its tau, the target's fingerprint, the run's name).
    """
    entry = {"train": train_fp, "export": store.url(export_path(store, train_fp, "vllm")),
             "at": datetime.now(timezone.utc).isoformat(timespec="seconds"), **about}
    old = pointer(store) or {"history": []}
    same = old.get("current") or {}
    if same.get("train") == train_fp and same.get("evaluate") == about.get("evaluate"):
        return old  # the same verdict applied again (a re-run reusing the stages): no new promotion
    data = {"current": entry, "history": [*old["history"], entry]}
    store.write_json(store.path(POINTER), data)
    return data
