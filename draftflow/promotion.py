"""Where the gate's `promoted` mark lives, and which drafter of a root it names: the one place both the gate
(`draftflow.gating`, which writes and removes the mark) and warm starts (`draftflow.training.warm`, which start from
the promoted drafter) read it from. Kept apart from the gate so the train stage's code hash does not take in the
gate's code (editing the gate never re-runs a stage).
"""

from __future__ import annotations

from draftflow.store import Store

PROMOTED = "promoted.json"


def marker_path(store: Store, train_fp: str) -> str:
    """Where the `promoted` marker of the train stage `train_fp`'s export lives."""
    return store.stage_path("train", train_fp, "export", PROMOTED)


def promoted_export(store: Store) -> tuple[str, str] | None:
    """(train fingerprint, its vLLM-native export folder) of the drafter this root's gate promoted last (the most
    recently written marker: a gate that passes writes it again), or None when nothing is promoted."""
    markers = store.fs.glob(marker_path(store, "*"))
    if not markers:
        return None
    newest = max(markers, key=lambda m: store.fs.modified(m).timestamp())
    fp = newest.rstrip("/").split("/")[-3]  # <root>/train/<fp>/export/promoted.json
    return fp, store.stage_path("train", fp, "export", "vllm")
