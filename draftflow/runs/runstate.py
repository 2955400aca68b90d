"""Where a run stands, read from its store: the stage walk `plan` and `status` share, and how far
an unfinished stage got.

A stage's fingerprint is known once its upstream manifests exist; the first stage without a
manifest is "to run", the stages after it "wait" (`stage_states`). For a stage that is not
complete, `stage_progress` reads what it left behind: its committed output shards against its
input shards, the in-shard checkpoints under `partial/` (regenerate's rows, extract's part
files), and for train the newest checkpoint it would resume from (in its work folder, or copied
to the store on a remote root).

What it does not know: sizes and times (`draftflow.runs.plan`), Prefect, or the stages' work. It
imports no torch, transformers or Prefect, so `draftflow status` answers in about a second;
the trade-off is that it repeats a few names the stage modules own (output shard names,
`partial/`, `checkpoints/step_*`, the train work folder), which tests/test_runstate.py checks
against them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from draftflow.config import RunConfig
from draftflow.contracts import Manifest
from draftflow.kept import default_cache_dir
from draftflow.stages.common import manifest_digest
from draftflow.stages.registry import resumes, spec, stage_inputs, stage_names, stamp, upstream_of
from draftflow.store import Store

PARTIAL = "partial"  # in-shard checkpoints of regenerate and extract (`stages.common.SCRATCH`)
CKPT_DIR = "checkpoints"  # `training.checkpoint.CKPT_DIR`: complete checkpoints are `step_<N>` folders
MIRROR_DONE = "COMPLETE"  # `training.mirror.MIRROR_DONE`: the marker of a checkpoint copied to the store


def stage_states(cfg: RunConfig, target_fp: str | None) -> tuple[list[dict[str, Any]], dict[str, Manifest]]:
    """Per stage (in order) its stage, fingerprint (None while its inputs are unknown) and state
    ("complete", "to run", "waits"); and the manifests of the complete stages."""
    store = Store(cfg.root)
    digests: dict[str, str] = {}
    manifests: dict[str, Manifest] = {}
    out, blocked = [], False
    for stage in stage_names():
        ups = upstream_of(stage)
        if blocked or any(u not in digests for u in ups):
            out.append({"stage": stage, "fingerprint": None, "state": "waits"})
            continue
        fp = stamp(cfg, stage, stage_inputs(cfg, stage, target_fp, digests)).fingerprint
        manifest = store.read_manifest(stage, fp)
        blocked = manifest is None
        out.append({"stage": stage, "fingerprint": fp, "state": "to run" if blocked else "complete"})
        if manifest is not None:
            digests[stage], manifests[stage] = manifest_digest(manifest), manifest
    return out, manifests


def stage_progress(store: Store, cfg: RunConfig, stage: str, fp: str,
                   manifests: dict[str, Manifest]) -> dict[str, Any] | None:
    """What an unfinished stage under `fp` has done; None when it keeps nothing to resume from.

    Returns, for a stage with one task per input shard: `shards_done` (output shards committed),
    `shards` (its input shards), `partial_rows` (rows in in-shard checkpoints), `partial_parts`
    (part files of in-shard checkpoints); for train: `resume_step` (None: it starts at step 0)
    and `checkpoint` (where that step is).
    """
    how = resumes(cfg, stage)
    if how == "steps":
        return train_progress(store, stage, fp)
    if how != "shards":
        return None
    s = spec(stage)
    inputs = manifests[s.upstream[0]].data_shards(s.split)
    names = _names(store, store.stage_path(stage, fp))
    suffix = s.output_suffix
    done = sum(_output_name(x.name, suffix) in names for x in inputs)
    rows, parts = _partial(store, store.stage_path(stage, fp, PARTIAL))
    return {"shards_done": done, "shards": len(inputs), "partial_rows": rows, "partial_parts": parts}


def _output_name(name: str, suffix: str | None) -> str:
    return name if suffix is None else name.replace(".parquet", suffix)


def _names(store: Store, folder: str) -> set[str]:
    if not store.exists(folder):
        return set()
    return {p.rstrip("/").rsplit("/", 1)[-1] for p in store.fs.ls(folder, detail=False)}


def _partial(store: Store, folder: str) -> tuple[int, int]:
    """Rows in the parquet files and the number of safetensors part files under `folder`."""
    if not store.exists(folder):
        return 0, 0
    import pyarrow.parquet as pq

    rows = parts = 0
    for path in store.fs.find(folder):
        if path.rsplit("/", 1)[-1].startswith("."):  # a file being written (`Store.writing`)
            continue
        if path.endswith(".safetensors"):
            parts += 1
        else:
            with store.fs.open(path, "rb") as f:
                rows += pq.read_metadata(f).num_rows
    return rows, parts


# ----------------------------------------------------------------------------- train


def train_work_dir(store: Store, stage: str, fp: str) -> str:
    """Where the train stage `stage`/`fp` trains and checkpoints (`stages.train.work_dir`, which imports torch)."""
    if store.is_local:
        return store.stage_path(stage, fp, "work")
    key = hashlib.sha256(store.stage_path(stage, fp).encode()).hexdigest()[:16]
    return str(default_cache_dir() / "train-work" / key)


def train_progress(store: Store, stage: str, fp: str) -> dict[str, Any]:
    """The step the train stage `stage`/`fp` resumes from: its newest complete checkpoint, in the work
    folder on this machine or (remote root) copied to the store; `resume_step` None when none."""
    found: list[tuple[int, str]] = []
    local = Path(train_work_dir(store, stage, fp)) / CKPT_DIR
    if local.is_dir():
        found += [(_step(p.name), str(p)) for p in local.glob("step_*") if p.is_dir() and _step(p.name) is not None]
    if not store.is_local:  # the copies in the store (`training.mirror`), complete once marked
        mirror = store.stage_path(stage, fp, "work", CKPT_DIR)
        for name in _names(store, mirror):
            path = f"{mirror}/{name}"
            if _step(name) is not None and store.exists(f"{path}/{MIRROR_DONE}"):
                found.append((_step(name), store.url(path)))
    step, where = max(found) if found else (None, None)
    return {"resume_step": step, "checkpoint": where}


def _step(name: str) -> int | None:
    head, _, number = name.partition("_")
    return int(number) if head == "step" and number.isdigit() else None
