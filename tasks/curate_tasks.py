"""Prefect tasks of the curate stage: one scan per source part, then one merge.

Scans are shard tasks (cached by the stage fingerprint and the part's content
key); a big part is scanned in its own process so scans run in parallel on the
flow's thread-pool runner despite the GIL. The merge is a whole-stage task: its
manifest is its cache.
"""

from __future__ import annotations

from prefect import task

from draftflow.config import RunConfig
from draftflow.contracts import Manifest, ShardResult, SourcePart, Stamp
from draftflow.stages import curate
from draftflow.store import Store
from tasks.stage_tasks import SHARD, STAGE


@task(name="curate-scan", **SHARD)
def curate_scan(cfg: RunConfig, fp: str, shard: SourcePart, tokenizer: str | None = None) -> ShardResult:
    return curate.scan_part_isolated(Store(cfg.root), fp, cfg, shard, tokenizer)


@task(name="curate-merge", **STAGE)
def curate_merge(cfg: RunConfig, stamp: Stamp, scans: list[ShardResult]) -> Manifest:
    return curate.merge(Store(cfg.root), stamp, cfg, scans)
