"""What every stage shares: shard results, rejects, accounting, manifests.

A shard function returns a `ShardResult` dict: the output shard's manifest
entry, its reject shard's entry (or None), and its accounting
(`rows_in = rows_out + sum(dropped)`, contract 4). `finalize` checks the
accounting of the whole stage and writes the manifest, last.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa

from draftflow.config import STAGE_SECTIONS, RunConfig
from draftflow.contracts import MANIFEST_VERSION, Manifest, ShardResult
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
    def of(cls, manifest: dict[str, Any]) -> Source:
        return cls(manifest["stage"], manifest["fingerprint"])


def fingerprint(stage: str, cfg: RunConfig, inputs: dict[str, str]) -> str:
    """The stage fingerprint from its config sections and input digests."""
    sections = {name: cfg.section(name) for name in STAGE_SECTIONS[stage]}
    return stage_fingerprint(stage, sections, inputs)


def shard_key(fingerprint_: str, input_sha: str, shard_name: str) -> str:
    """Cache key of one shard task: content only, never a path or a time (contract 2)."""
    return digest({"stage": fingerprint_, "input": input_sha, "name": shard_name})[:32]


def write_parquet(store: Store, stage: str, fp: str, name: str, rows: list[dict], schema: pa.Schema,
                  tokens: int = 0, **extra: Any) -> dict[str, Any]:
    """Write rows as one parquet shard under the stage folder; return its entry."""
    dest = store.stage_path(stage, fp, name)
    with store.writing(dest) as tmp:
        write_rows(tmp, rows, schema)
        entry = shard_entry(name, tmp, rows=len(rows), tokens=tokens, **extra)
    return entry


def write_rejects(store: Store, stage: str, fp: str, name: str, rejects: list[dict]) -> dict[str, Any] | None:
    """Bad rows with their reason go to `rejected-<name>`, never only to the log."""
    if not rejects:
        return None
    return write_parquet(store, stage, fp, f"rejected-{name}", rejects, REJECTED)


def reject(source: str, reason: str, detail: str, row: Any) -> dict[str, str]:
    import json

    text = row if isinstance(row, str) else json.dumps(row, ensure_ascii=False, default=str)
    return {"source": source, "reason": reason, "detail": detail[:500], "row": text[:20000]}


def shard_result(entry: dict | None, rejected: dict | None, rows_in: int, rows_out: int,
                 dropped: Counter | dict, **extra: Any) -> dict[str, Any]:
    result = {"shard": entry, "rejected": rejected, "rows_in": rows_in, "rows_out": rows_out,
              "dropped": dict(sorted(dict(dropped).items())), **extra}
    check_accounting(result, entry["name"] if entry else "shard")
    ShardResult.model_validate(result)  # the typed contract: entries complete, counts non-negative
    return result


def check_accounting(counts: dict[str, Any], what: str) -> None:
    lost = counts["rows_in"] - counts["rows_out"] - sum(counts["dropped"].values())
    if lost:
        raise AssertionError(f"{what}: {lost} rows unaccounted for (rows_in={counts['rows_in']}, "
                             f"rows_out={counts['rows_out']}, dropped={counts['dropped']})")


def finalize(store: Store, stage: str, fp: str, cfg: RunConfig, inputs: dict[str, str],
             results: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Sum the shard results, check the accounting and write the manifest (last)."""
    dropped: Counter = Counter()
    for r in results:
        dropped.update(r["dropped"])
    manifest = {
        "version": MANIFEST_VERSION,
        "stage": stage,
        "fingerprint": fp,
        "code_version": code_version(stage),
        "config": {name: cfg.section(name) for name in STAGE_SECTIONS[stage]},
        "inputs": inputs,
        "shards": [r["shard"] for r in results if r["shard"]],
        "rejected": [r["rejected"] for r in results if r["rejected"]],
        "rows_in": sum(r["rows_in"] for r in results),
        "rows_out": sum(r["rows_out"] for r in results),
        "dropped": dict(sorted(dropped.items())),
        "tokens": sum(r["shard"]["tokens"] for r in results if r["shard"]),
        "extra": extra or {},
    }
    check_accounting(manifest, stage)
    Manifest.model_validate(manifest)  # the typed contract, before anything is written
    store.write_manifest(stage, fp, manifest)
    tidy_complete(store, stage, fp)
    log.info("%s: %d rows in, %d out, dropped %s", stage, manifest["rows_in"], manifest["rows_out"],
             manifest["dropped"])
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


def require_rows(manifest: dict[str, Any]) -> None:
    """Stop the run in one line when a stage kept nothing: which stage, and its top drop reasons.

    Raises:
        EmptyStage: the manifest's rows_out is 0.
    """
    if manifest["rows_out"]:
        return
    top = sorted(manifest["dropped"].items(), key=lambda kv: -kv[1])[:3]
    why = ", ".join(f"{k}={v}" for k, v in top) or "its input was empty"
    raise EmptyStage(f"{manifest['stage']} kept no rows of {manifest['rows_in']} (dropped {why}); the stages after "
                     f"it have nothing to work on: see its rejected-* shards, fix the cause and re-run")


def manifest_digest(manifest: dict[str, Any]) -> str:
    return digest(manifest)


def data_shards(manifest: dict[str, Any], split: str | None = None) -> list[dict[str, Any]]:
    """The manifest's data shards, optionally of one split."""
    return [s for s in manifest["shards"] if split is None or s.get("split") == split]
