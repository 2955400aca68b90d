"""One Prefect flow per stage, each a few lines over `run_stage`.

Each flow takes the run config, the target reference and its upstream stage
results, and returns its own stage result (status, fingerprint, manifest).
"""

from __future__ import annotations

import os
from collections import Counter

from prefect import flow

from draftflow.config import RunConfig
from draftflow.data.stats import table_rows
from draftflow.plan import check_space
from draftflow.stages.common import data_shards, finalize
from draftflow.stages.curate import check_sources, plan_parts, token_counter
from draftflow.stages.extract import bad_shards, online_manifest
from draftflow.stages.regenerate import check_engine
from draftflow.stages.registry import stage_inputs
from draftflow.stages.tokenize import write_vocab_files
from draftflow.store import MANIFEST
from draftflow.target import TargetRef
from draftflow.training.metrics import metrics_table
from flows.common import map_shards, publish_table, reuse, run_stage
from flows.runners import StageTaskRunner
from tasks import curate_tasks as CT
from tasks import stage_tasks as T


def target_ref(target: dict) -> TargetRef:
    return TargetRef(**target)


def _inputs(cfg: RunConfig, stage: str, target: dict, **upstream: dict) -> dict[str, str]:
    """The stage's fingerprint inputs, computed as `plan` computes them (`registry.stage_inputs`)."""
    return stage_inputs(cfg, stage, target["fingerprint"], {k: v["digest"] for k, v in upstream.items()})


@flow(name="curate", task_runner=StageTaskRunner("curate", max_workers=os.cpu_count() or 2))
def curate_flow(cfg: RunConfig) -> dict:
    """Scan every source part in parallel, then one merge (dedup, mixture, split, shards)."""
    check_sources(cfg.curate)  # fails here, before any work, on an unreachable source
    inputs, tokenizer = stage_inputs(cfg, "curate", None, {}), token_counter(cfg)

    def work(store, fp):
        scans = map_shards(CT.curate_scan, store, "curate", plan_parts(cfg.curate), cfg=cfg, fp=fp,
                           tokenizer=tokenizer)
        return CT.curate_merge(cfg=cfg, fp=fp, inputs=inputs, scans=scans)
    result = run_stage(cfg, "curate", inputs, work)
    publish_table(cfg, "curate", "sources", table_rows(result["manifest"]["extra"].get("sources", {})),
                  "curate: rows read, kept and dropped by reason per source")
    return result


@flow(name="regenerate", task_runner=StageTaskRunner("regenerate"))
def regenerate_flow(cfg: RunConfig, target: dict, curated: dict) -> dict:
    inputs = _inputs(cfg, "regenerate", target, curate=curated)

    def work(store, fp):
        check_engine(cfg, target_ref(target))  # an unreachable endpoint fails here, before any shard
        shards = data_shards(curated["manifest"], "train")
        results = map_shards(T.regenerate_shard, store, "regenerate", shards, cfg=cfg, fp=fp, target=target,
                             input_fp=curated["fingerprint"])
        return finalize(store, "regenerate", fp, cfg, inputs, results)
    return run_stage(cfg, "regenerate", inputs, work)


@flow(name="tokenize", task_runner=StageTaskRunner("tokenize"))
def tokenize_flow(cfg: RunConfig, target: dict, regenerated: dict) -> dict:
    inputs = _inputs(cfg, "tokenize", target, regenerate=regenerated)

    def work(store, fp):
        results = map_shards(T.tokenize_shard, store, "tokenize", data_shards(regenerated["manifest"]), cfg=cfg, fp=fp,
                             target=target, input_fp=regenerated["fingerprint"])
        vocab_files = write_vocab_files(store, fp, cfg, target_ref(target), results)
        drops: Counter = sum((Counter(r["sequence_drops"]) for r in results), Counter())
        results += [{"shard": e, "rejected": None, "rows_in": 0, "rows_out": 0, "dropped": {}} for e in vocab_files]
        extra = {"sequences": sum(r["shard"]["sequences"] for r in results if r["shard"] and "sequences" in r["shard"]),
                 "sequences_dropped": dict(sorted(drops.items())), "policy": cfg.tokenize.policy}
        return finalize(store, "tokenize", fp, cfg, inputs, results, extra=extra)
    return run_stage(cfg, "tokenize", inputs, work)


@flow(name="extract", task_runner=StageTaskRunner("extract"))
def extract_flow(cfg: RunConfig, target: dict, tokenized: dict) -> dict:
    """Feature shards are checked by size before the stage is reused (hashing terabytes every run
    would cost a full read; train hashes what it reads) and by sha256 when taken from the task
    cache; a bad one drops the manifest and only that shard is recomputed."""
    inputs = _inputs(cfg, "extract", target, tokenize=tokenized)
    store, fp, manifest = reuse(cfg, "extract", inputs)
    if manifest is not None and bad_shards(store, fp, manifest["shards"], checksum=False):
        store.fs.rm(store.stage_path("extract", fp, MANIFEST))

    def work(store, fp):
        if cfg.extract.mode == "online":  # nothing stored: train computes the features per batch
            return online_manifest(store, fp, cfg, inputs, tokenized)
        check_space(cfg, tokenized["manifest"], target_ref(target), fp=fp)  # before any shard
        shards = data_shards(tokenized["manifest"], "train")
        results = map_shards(T.extract_shard, store, "extract", shards,
                             verify=lambda entries: set(bad_shards(store, fp, entries)),
                             cfg=cfg, fp=fp, target=target, input_fp=tokenized["fingerprint"])
        return finalize(store, "extract", fp, cfg, inputs, results)
    return run_stage(cfg, "extract", inputs, work)


@flow(name="train")
def train_flow(cfg: RunConfig, target: dict, features: dict) -> dict:
    inputs = _inputs(cfg, "train", target, extract=features)

    def work(store, fp):
        return T.train_drafter(cfg=cfg, fp=fp, target=target, inputs=inputs,
                                                     features=features)
    result = run_stage(cfg, "train", inputs, work)
    publish_table(cfg, "train", "metrics", metrics_table(result["manifest"]["extra"].get("metrics") or {}),
                  "Final training metrics: loss, tau estimate, accuracy per block position")
    return result


@flow(name="evaluate")
def evaluate_flow(cfg: RunConfig, target: dict, curated: dict, trained: dict) -> dict:
    inputs = _inputs(cfg, "evaluate", target, curate=curated, train=trained)

    def work(store, fp):
        return T.evaluate_drafter(cfg=cfg, fp=fp, target=target, inputs=inputs, curated=curated,
                                  trained=trained)
    return run_stage(cfg, "evaluate", inputs, work)
