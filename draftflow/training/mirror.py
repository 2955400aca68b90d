"""Copies of training checkpoints in the store, so a retry elsewhere resumes (remote roots only).

On an s3:// root the work folder is on the worker's local disk; a retry on another pod or
machine would start from step 0. Each checkpoint is therefore copied under
`train/<fp>/work/checkpoints/step_N/` in the store, its `COMPLETE` marker last, and the
newest complete one is pulled back before training when it is newer than any local one.

Several nodes: each node trains in its own work folder; before training every node aligns it
with the store (`align_with_store`), so all ranks resume from the same checkpoint.

What it does not know: which folder of the store is the copy (the train stage names it),
the checkpoint's contents (`draftflow.training.checkpoint`).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from draftflow.store import Store
from draftflow.training.checkpoint import CKPT_DIR, KEEP_CHECKPOINTS, latest_checkpoint

log = logging.getLogger(__name__)
MIRROR_DONE = "COMPLETE"


def _remote_steps(store: Store, mirror: str) -> list[str]:
    """Complete remote checkpoint folders, oldest first."""
    store.fs.invalidate_cache(mirror)  # other processes and nodes write here
    if not store.fs.exists(mirror):
        return []
    found = sorted(p.rstrip("/") for p in store.fs.ls(mirror, detail=False) if p.rstrip("/").split("/")[-1]
                   .startswith("step_"))
    return [p for p in found if store.fs.exists(f"{p}/{MIRROR_DONE}")]


def push_checkpoint(store: Store, mirror: str, folder: Path) -> None:
    """Copy a complete local checkpoint folder to the store (marker last), keeping the newest few."""
    dest = f"{mirror}/{folder.name}"
    for f in sorted(folder.iterdir()):
        store.fs.put_file(str(f), f"{dest}/{f.name}")
    store.fs.pipe_file(f"{dest}/{MIRROR_DONE}", b"")
    for old in _remote_steps(store, mirror)[:-KEEP_CHECKPOINTS]:
        store.fs.rm(old, recursive=True)


def align_with_store(store: Store, mirror: str, out: str) -> Path | None:
    """Make the store's newest complete checkpoint the newest one in `out` (several nodes).

    Local checkpoints newer than it were never confirmed in the store (the node died while
    copying): another node resumes from the store's, and every rank must resume from the same
    step, so they are deleted. Then the store's newest is pulled if `out` lacks it.
    """
    remote = _remote_steps(store, mirror)
    newest = remote[-1].split("/")[-1] if remote else ""
    root = Path(out) / CKPT_DIR
    for local in sorted(root.glob("step_*")) if root.is_dir() else []:
        if local.name > newest:
            log.info("dropping checkpoint %s: the store's newest is %s", local, newest or "none")
            shutil.rmtree(local)
    return pull_checkpoint(store, mirror, out)


def pull_checkpoint(store: Store, mirror: str, out: str) -> Path | None:
    """Fetch the newest complete remote checkpoint into `out/checkpoints` if newer than the local ones."""
    remote = _remote_steps(store, mirror)
    local = latest_checkpoint(out)
    if not remote or (local is not None and local.name >= remote[-1].split("/")[-1]):
        return None
    name = remote[-1].split("/")[-1]
    root = Path(out) / CKPT_DIR
    tmp, final = root / f".tmp_{name}", root / name
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in store.fs.ls(remote[-1], detail=False):
        if not f.endswith(MIRROR_DONE):
            store.fs.get_file(f, str(tmp / f.rstrip("/").split("/")[-1]))
    tmp.rename(final)
    log.info("resuming from the checkpoint copied to the store: %s", store.url(remote[-1]))
    return final
