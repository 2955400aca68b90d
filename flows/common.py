"""What every stage flow does around its tasks: reuse check, fan-out, manifest, artifacts.

A stage flow first looks for a complete manifest under its fingerprint and
returns it untouched ("reused"); otherwise it maps its shard task over the
input shards (finished shards come back Cached), writes the manifest through
the library and publishes a count table.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import get_run_logger, unmapped
from prefect.artifacts import create_table_artifact

from draftflow.config import RunConfig
from draftflow.stages.common import fingerprint, manifest_digest
from draftflow.store import Store


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")


def with_storage(task_fn, store: Store):
    """Persist task results next to the run's data when the root is local.

    Deleting a run folder then also forgets its cache records, so a cache hit
    never points at data that is gone. S3 roots use Prefect's configured default.
    """
    if store.is_local:
        return task_fn.with_options(result_storage=Path(store.base) / "_prefect_results")
    return task_fn


def stage_result(store: Store, stage: str, fp: str, manifest: dict, status: str) -> dict[str, Any]:
    return {
        "stage": stage, "fingerprint": fp, "status": status, "digest": manifest_digest(manifest),
        "path": store.url(store.stage_path(stage, fp)), "manifest": manifest,
    }


def reuse(cfg: RunConfig, stage: str, inputs: dict[str, str]) -> tuple[Store, str, dict | None]:
    """(store, fingerprint, complete manifest or None) for this stage."""
    store = Store(cfg.root)
    fp = fingerprint(stage, cfg, inputs)
    return store, fp, store.read_manifest(stage, fp)


def map_shards(task_fn, store: Store, stage: str, shards: list[dict],
               verify: Callable[[list[dict]], set[str]] | None = None, **kwargs: Any) -> list[dict]:
    """Run one task per shard; a result taken from the cache whose shard file is gone, or fails
    `verify` (shard entries -> names of bad ones, e.g. a sha256 check), is recomputed.

    Freshly computed shards are not re-checked: their task just hashed what it wrote.
    """
    task_fn = with_storage(task_fn, store)
    fixed = {k: unmapped(v) for k, v in kwargs.items()}
    futures = task_fn.map(shard=shards, **fixed)
    results = [f.result() for f in futures]
    stage_dir = store.stage_path(stage, kwargs["fp"])
    cached = [r["shard"] for f, r in zip(futures, results) if f.state.name == "Cached" and r["shard"]]
    bad = {e["name"] for e in cached if not store.exists(f"{stage_dir}/{e['name']}")}
    if verify is not None:
        bad |= set(verify([e for e in cached if e["name"] not in bad]))
    for i, r in enumerate(results):
        if r["shard"] and r["shard"]["name"] in bad:
            get_run_logger().warning("cached shard %s is missing or damaged; recomputing", r["shard"]["name"])
            results[i] = task_fn.with_options(refresh_cache=True)(shard=shards[i], **kwargs)
    return results


def publish_counts(cfg: RunConfig, stage: str, result: dict[str, Any]) -> None:
    m = result["manifest"]
    rows = [{"stage": stage, "status": result["status"], "rows_in": m["rows_in"], "rows_out": m["rows_out"],
             "tokens": m["tokens"], "shards": len(m["shards"]), **{f"dropped:{k}": v for k, v in m["dropped"].items()}}]
    create_table_artifact(table=rows, key=artifact_key(cfg.name, stage, "counts"),
                          description=f"{stage}: rows in/out and drops by reason ({result['path']})")
    get_run_logger().info("%s %s: %d rows in, %d out, dropped %s -> %s", stage, result["status"],
                          m["rows_in"], m["rows_out"], m["dropped"] or "nothing", result["path"])


def publish_table(cfg: RunConfig, stage: str, what: str, rows: list[dict[str, Any]], description: str) -> None:
    """A table artifact keyed by run, stage and `what` (nothing when there are no rows)."""
    if rows:
        create_table_artifact(table=rows, key=artifact_key(cfg.name, stage, what), description=description)


def run_stage(cfg: RunConfig, stage: str, inputs: dict[str, str], work: Callable[[Store, str], dict]) -> dict:
    """Reuse a complete stage, or run `work(store, fp)` (which returns the manifest)."""
    store, fp, manifest = reuse(cfg, stage, inputs)
    status = "reused"
    if manifest is None:
        manifest, status = work(store, fp), "ran"
    result = stage_result(store, stage, fp, manifest, status)
    publish_counts(cfg, stage, result)
    return result
