"""What every stage shares: shard results, rejects, accounting, manifests.

A shard function returns a `contracts.ShardResult`: the output shard's manifest
entry, its reject shard's entry (or None), and its accounting
(`rows_in = rows_out + sum(dropped)`, contract 4). `finalize` checks the
accounting of the whole stage and writes the `contracts.Manifest`, last.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa

from draftflow.config import RunConfig
from draftflow.contracts import MANIFEST_VERSION, Manifest, ShardEntry, ShardResult, StageResult, Stamp
from draftflow.data.schema import REJECTED, write_rows
from draftflow.errors import DraftflowError
from draftflow.store import Store, code_version, digest, shard_entry, stage_fingerprint

log = logging.getLogger(__name__)


class Source(NamedTuple):
    """Where a stage's input shards live: the upstream stage's name and fingerprint. A stage reads
    its input through this, so it never names the stage before it (a stage can be put in between)."""

    stage: str
    fingerprint: str

    @classmethod
    def of(cls, manifest: Manifest) -> Source:
        return cls(manifest.stage, manifest.fingerprint)


def stamp(stage: str, sections: tuple[str, ...], cfg: RunConfig, inputs: dict[str, str]) -> Stamp:
    """The stage's `Stamp`: its fingerprint from the config `sections` it reads (its `StageSpec`'s) and its
    inputs' digests (contract 1)."""
    config = {name: cfg.section(name) for name in sections}
    return Stamp(stage=stage, fingerprint=stage_fingerprint(stage, config, inputs), inputs=inputs, config=config)


def shard_key(fingerprint_: str, input_sha: str, shard_name: str) -> str:
    """Cache key of one shard task: content only, never a path or a time (contract 2)."""
    return digest({"stage": fingerprint_, "input": input_sha, "name": shard_name})[:32]


def write_parquet(store: Store, stage: str, fp: str, name: str, rows: list[dict], schema: pa.Schema,
                  tokens: int = 0, **extra: Any) -> ShardEntry:
    """Write rows as one parquet shard under the stage folder; return its entry."""
    dest = store.stage_path(stage, fp, name)
    with store.writing(dest) as tmp:
        write_rows(tmp, rows, schema)
        entry = shard_entry(name, tmp, rows=len(rows), tokens=tokens, **extra)
    return entry


def write_rejects(store: Store, stage: str, fp: str, name: str, rejects: list[dict]) -> ShardEntry | None:
    """Bad rows with their reason go to `rejected-<name>`, never only to the log."""
    if not rejects:
        return None
    return write_parquet(store, stage, fp, f"rejected-{name}", rejects, REJECTED)


def reject(source: str, reason: str, detail: str, row: Any) -> dict[str, str]:
    import json

    text = row if isinstance(row, str) else json.dumps(row, ensure_ascii=False, default=str)
    return {"source": source, "reason": reason, "detail": detail[:500], "row": text[:20000]}


def shard_result(entry: ShardEntry | None, rejected: ShardEntry | None, rows_in: int, rows_out: int,
                 dropped: Counter | dict, **info: Any) -> ShardResult:
    """A shard's result; `info`: the stage's own per-shard figures (`ShardResult.info`).

    Raises:
        pydantic.ValidationError: the rows are not accounted for (contract 4) or a count is negative.
    """
    return ShardResult(shard=entry, rejected=rejected, rows_in=rows_in, rows_out=rows_out,
                       dropped=dict(sorted(dict(dropped).items())), info=info)


def finalize(store: Store, stamp: Stamp, results: list[ShardResult], extra: dict[str, Any] | None = None) -> Manifest:
    """Sum the shard results, check the accounting and write the manifest (last) of the stage `stamp` names."""
    stage, fp = stamp.stage, stamp.fingerprint
    dropped: Counter = Counter()
    for r in results:
        dropped.update(r.dropped)
    manifest = Manifest(  # validated here: the accounting of the whole stage, before anything is written
        version=MANIFEST_VERSION, stage=stage, fingerprint=fp, code_version=code_version(stage),
        config=stamp.config, inputs=stamp.inputs,
        shards=tuple(r.shard for r in results if r.shard), rejected=tuple(r.rejected for r in results if r.rejected),
        rows_in=sum(r.rows_in for r in results), rows_out=sum(r.rows_out for r in results),
        dropped=dict(sorted(dropped.items())), tokens=sum(r.shard.tokens for r in results if r.shard),
        extra=extra or {})
    store.write_manifest(stage, fp, manifest)
    tidy_complete(store, stage, fp)
    log.info("%s: %d rows in, %d out, dropped %s", stage, manifest.rows_in, manifest.rows_out, manifest.dropped)
    return manifest


# Resume folders: in-shard checkpoints (regenerate, extract), source parts (curate), train's work folder
# (checkpoints, work copies of the exports). Dead weight once the stage's manifest is written.
SCRATCH = ("partial", "parts", "work")


def remove_scratch(store: Store, stage: str, fp: str, name: str) -> None:
    """Remove one resume folder of a complete stage; best effort (a failure only logs)."""
    path = store.stage_path(stage, fp, name)
    try:
        if store.exists(path):
            store.fs.rm(path, recursive=True)
    except OSError as exc:
        log.warning("%s: could not remove %s (%s); it is not needed any more", stage, store.url(path), exc)


def tidy_complete(store: Store, stage: str, fp: str) -> None:
    """Leave a complete stage folder holding what its manifest lists: no resume folders, and (local roots)
    no temp files of writes a killed process never committed. Run when the manifest is written and again
    when a complete stage is reused, since a run can be killed between the manifest and the clean-up."""
    for name in SCRATCH:
        remove_scratch(store, stage, fp, name)
    if store.is_local:
        for tmp in Path(store.stage_path(stage, fp)).glob(".*.tmp"):  # Store.writing's mkstemp names
            tmp.unlink(missing_ok=True)


class EmptyStage(DraftflowError):
    """A stage kept no rows, and the stages after it need some."""


def require_rows(manifest: Manifest) -> None:
    """Stop the run in one line when a stage kept nothing: which stage, and its top drop reasons.

    Raises:
        EmptyStage: the manifest's rows_out is 0.
    """
    if manifest.rows_out:
        return
    top = sorted(manifest.dropped.items(), key=lambda kv: -kv[1])[:3]
    why = ", ".join(f"{k}={v}" for k, v in top) or "its input was empty"
    raise EmptyStage(f"{manifest.stage} kept no rows of {manifest.rows_in} (dropped {why}); the stages after "
                     f"it have nothing to work on: see its rejected-* shards, fix the cause and re-run")


def manifest_digest(manifest: Manifest) -> str:
    """What downstream fingerprints take as this stage's input: the digest of the manifest as written."""
    return digest(manifest.to_json())


def stage_result(store: Store, manifest: Manifest, status: str) -> StageResult:
    """What a stage flow returns for a complete stage."""
    return StageResult(stage=manifest.stage, fingerprint=manifest.fingerprint, status=status,
                       digest=manifest_digest(manifest), manifest=manifest,
                       path=store.url(store.stage_path(manifest.stage, manifest.fingerprint)))
