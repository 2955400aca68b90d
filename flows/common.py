"""What every stage flow does around its tasks: reuse check, fan-out, manifest, artifacts.

A stage flow first looks for a complete manifest under its fingerprint and
returns it untouched ("reused"); otherwise it maps its shard task over the
input shards (finished shards come back Cached), writes the manifest through
the library and publishes a count table.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from prefect import get_run_logger, unmapped
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.futures import as_completed

from draftflow import interrupt, progress
from draftflow.config import RunConfig
from draftflow.contracts import Manifest, ShardEntry, ShardResult, StageResult, Stamp
from draftflow.stages.common import stage_result, tidy_complete
from draftflow.stages.registry import spec, stage_gpus, stamp
from draftflow.store import Store
from flows.deploy import gpu_slot
from flows.keys import artifact_key, run_key
from flows.progress import track
from flows.signals import stop_soon


def with_storage(task_fn, store: Store):
    """Persist task results under the run root: `<root>/_prefect_results`, local or remote.

    Deleting a run folder (or prefix) then also forgets its cache records, so a cache hit
    never points at data that is gone; and results outlive a container worker. A remote
    root (s3://…) gets a `RemoteFileSystem` block (Prefect wants it saved; it is named after
    the path) with no settings: each process that reads or writes results (the flow, a Ray
    worker) finds credentials and endpoint in its own environment, so none is stored in
    Prefect's database or in the results.
    """
    if store.is_local:
        return task_fn.with_options(result_storage=Path(store.base) / "_prefect_results")
    import hashlib

    from prefect.filesystems import RemoteFileSystem

    basepath = store.url(store.path("_prefect_results"))
    block = RemoteFileSystem(basepath=basepath)
    block.save(f"draftflow-results-{hashlib.sha256(basepath.encode()).hexdigest()[:16]}", overwrite=True)
    return task_fn.with_options(result_storage=block)


def reuse(cfg: RunConfig, stage: str, inputs: dict[str, str]) -> tuple[Store, Stamp, Manifest | None]:
    """(store, the stage's stamp (its fingerprint), complete manifest or None) for this stage."""
    store = Store(cfg.root)
    handed = stamp(cfg, stage, inputs)
    manifest = store.read_manifest(stage, handed.fingerprint)
    if manifest is not None:  # a run killed after the manifest left its resume folders
        tidy_complete(store, stage, handed.fingerprint)
    return store, handed, manifest


def map_shards(task_fn, store: Store, stage: str, shards: list,
               verify: Callable[[list[ShardEntry]], set[str]] | None = None, **kwargs: Any) -> list[ShardResult]:
    """Run one task per shard; a result taken from the cache whose shard file is gone, or fails
    `verify` (shard entries -> names of bad ones, e.g. a sha256 check), is recomputed.

    Freshly computed shards are not re-checked: their task just hashed what it wrote.
    """
    task_fn = with_storage(task_fn, store)
    fixed = {k: unmapped(v) for k, v in kwargs.items()}
    try:
        with gpu_slot(gpus=stage_gpus(kwargs["cfg"], stage)) if spec(stage).gpu == "shards" else nullcontext():
            futures = task_fn.map(shard=shards, **fixed)
            by_rows = all(isinstance(s, ShardEntry) for s in shards)  # curate's source parts have no row count
            track(run_key(kwargs["cfg"]), stage, sum(s.rows for s in shards) if by_rows else len(shards),
                  "rows" if by_rows else "parts")
            for f in as_completed(futures):  # shard-level progress; the library reports rows inside shards
                _shard_done(stage, shards[futures.index(f)], f, by_rows)
            results = [f.result() for f in futures]
            # Recomputed on the same runner (Ray too) and still holding the GPU slot.
            redo = _damaged(store, stage, kwargs["fp"], futures, results, verify)
            again = [task_fn.with_options(refresh_cache=True).submit(shard=shards[i], **kwargs) for i in redo]
            for i, f in zip(redo, again):
                results[i] = f.result()
    except BaseException as exc:  # wherever it lands while shards run (even while they are being submitted)
        if not isinstance(exc, Exception):  # SIGTERM/SIGINT as Prefect raises them (TerminationSignal): the
            interrupt.request()  # shard tasks in worker threads stop between their batches, not at their end,
            logging.disable(logging.CRITICAL)  # quietly (the CLI prints the one line, `flows.signals`)
            stop_soon(getattr(exc, "signal", signal.SIGTERM))  # and shards that cannot stop are not waited for
        raise
    progress.finish(stage)
    return results


def _damaged(store: Store, stage: str, fp: str, futures, results: list[ShardResult],
             verify: Callable[[list[ShardEntry]], set[str]] | None) -> list[int]:
    """Positions of results taken from the cache whose shard is missing or damaged: it fails `verify`
    (extract: sizes, then sha256), or by default its sha256 (every other stage: parquet shards are small).
    A damaged shard is recomputed, so a re-run never gets stuck on the cache handing it back."""
    stage_dir = store.stage_path(stage, fp)
    cached = [r.shard for f, r in zip(futures, results) if f.state.name == "Cached" and r.shard]
    bad = {e.name for e in cached if not store.exists(f"{stage_dir}/{e.name}")}
    verify = verify or (lambda entries: {e.name for e in entries if not store.sha_matches(stage, fp, e)})
    bad |= set(verify([e for e in cached if e.name not in bad]))
    redo = [i for i, r in enumerate(results) if r.shard and r.shard.name in bad]
    for i in redo:
        get_run_logger().warning("cached shard %s is missing or damaged; recomputing", results[i].shard.name)
    return redo


def _shard_done(stage: str, shard, future, by_rows: bool) -> None:
    """Count a finished shard (a cached one as found, not worked); a failed one counts nothing."""
    future.wait()  # sets the future's final state (the API's copy of it may lag)
    if future.state.is_completed():
        out = future.result().shard
        n = shard.rows if by_rows else 1
        progress.report(stage, n, n, part=out.name if out else shard.name, skipped=future.state.name == "Cached")


def publish_counts(cfg: RunConfig, stage: str, result: StageResult) -> None:
    m = result.manifest
    rows = [{"stage": stage, "status": result.status, "rows_in": m.rows_in, "rows_out": m.rows_out,
             "tokens": m.tokens, "shards": len(m.shards), **{f"dropped:{k}": v for k, v in m.dropped.items()}}]
    create_table_artifact(table=rows, key=artifact_key(run_key(cfg), stage, "counts"),
                          description=f"{stage}: rows in/out and drops by reason ({result.path})")
    get_run_logger().info("%s %s: %d rows in, %d out, dropped %s -> %s", stage, result.status,
                          m.rows_in, m.rows_out, m.dropped or "nothing", result.path)


def publish_links(cfg: RunConfig, links: dict[str, str]) -> None:
    """One artifact per named output (`<run>-checkpoint`, `<run>-report`): a link where a browser can open it
    (http(s)://), else its location as text (a file:// or s3:// link from the UI's page opens nothing; the
    report itself is inlined in the `<run>-result` artifact)."""
    for what, location in links.items():
        key = artifact_key(run_key(cfg), what)
        if location.startswith(("http://", "https://")):
            create_link_artifact(link=location, link_text=location, key=key, description=f"{cfg.name}: {what}")
            continue
        on = "store" if "://" in location else "machine"
        create_markdown_artifact(f"**{what}**: `{location}`\n\n(on the run's {on}; the report is inlined in the "
                                 f"`{run_key(cfg)}-result` artifact)", key=key, description=f"{cfg.name}: {what}")


def publish_table(cfg: RunConfig, stage: str, what: str, rows: list[dict[str, Any]], description: str) -> None:
    """A table artifact keyed by run, stage and `what` (nothing when there are no rows)."""
    if rows:
        create_table_artifact(table=rows, key=artifact_key(run_key(cfg), stage, what), description=description)


def run_stage(cfg: RunConfig, stage: str, inputs: dict[str, str],
              work: Callable[[Store, Stamp], Manifest]) -> StageResult:
    """Reuse a complete stage, or run `work(store, stamp)` (which returns the manifest)."""
    store, handed, manifest = reuse(cfg, stage, inputs)
    status = "reused"
    if manifest is None:
        manifest, status = work(store, handed), "ran"
    result = stage_result(store, manifest, status)
    publish_counts(cfg, stage, result)
    return result
