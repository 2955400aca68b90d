"""One Prefect flow per stage, each a few lines over `run_stage`.

Each flow takes the run config, the target reference and its upstream stage
results, and returns its own stage result (status, fingerprint, manifest).
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager

from prefect import flow

from draftflow import progress
from draftflow.config import RunConfig
from draftflow.contracts import StageResult, carry, feature_source
from draftflow.data.stats import table_rows
from draftflow.runs.plan import check_space
from draftflow.stages.common import Source, finalize
from draftflow.stages.curate import check_sources, plan_parts, token_counter
from draftflow.stages.extract import bad_shards, drop_manifest_if_damaged, online_manifest
from draftflow.stages.registry import device_tags, spec, stage_inputs
from draftflow.target import TargetRef
from draftflow.training.metrics import metrics_table
from flows import heartbeats
from flows.common import map_shards, publish_table, reuse, run_stage
from flows.keys import run_key
from flows.progress import install
from flows.runners import StageTaskRunner
from flows.schemas import no_parameter_schema
from tasks import curate_tasks as CT
from tasks import stage_tasks as T

heartbeats.install()  # a stage subflow's end does not wait on its heartbeat thread (up to 1 s a stage)


def target_ref(target: dict) -> TargetRef:
    return TargetRef(**target)


def _inputs(cfg: RunConfig, stage: str, target: dict, *upstream: StageResult) -> dict[str, str]:
    """The stage's fingerprint inputs, computed as `plan` computes them (`registry.stage_inputs`), from the
    upstream results it was handed (each under its own stage's name)."""
    return stage_inputs(cfg, stage, target["fingerprint"], {u.stage: u.digest for u in upstream})


@flow(name="curate", task_runner=StageTaskRunner("curate", max_workers=os.cpu_count() or 2))
@no_parameter_schema
def curate_flow(cfg: RunConfig) -> StageResult:
    """Scan every source part in parallel, then one merge (dedup, mixture, split, shards)."""
    check_sources(cfg.curate)  # fails here, before any work, on an unreachable source
    inputs, tokenizer = stage_inputs(cfg, "curate", None, {}), token_counter(cfg)

    def work(store, handed):
        scans = map_shards(CT.curate_scan, store, "curate", plan_parts(cfg.curate), cfg=cfg, fp=handed.fingerprint,
                           tokenizer=tokenizer)
        return CT.curate_merge(cfg=cfg, stamp=handed, scans=scans)
    result = run_stage(cfg, "curate", inputs, work)
    publish_table(cfg, "curate", "sources", table_rows(result.manifest.extra.get("sources", {})),
                  "curate: rows read, kept and dropped by reason per source")
    return result


def shard_task(stage: str, cfg: RunConfig):
    """The shard task of a registry stage: named after it, tagged `gpu` when its shards use one in this run."""
    return T.stage_shard.with_options(name=f"{stage}-shard", tags=device_tags(cfg, stage))


@functools.cache  # one flow per stage name
def sharded_stage_flow(stage: str):
    """The flow of a registry stage with one task per input shard (`StageSpec.run_shard`): the
    spec's check, its shard tasks over the upstream's shards, the spec's finish, the manifest."""
    @flow(name=stage, task_runner=StageTaskRunner(stage))
    @no_parameter_schema
    def stage_flow(cfg: RunConfig, target: dict, upstream: StageResult) -> StageResult:
        s = spec(stage)  # read at run time: a test may put a stage in front of this one
        inputs = _inputs(cfg, stage, target, upstream)

        def work(store, handed):
            if s.check:  # e.g. an unreachable endpoint fails here, before any shard
                s.check(cfg, target_ref(target))
            shards, fp = upstream.manifest.data_shards(s.split), handed.fingerprint
            results = map_shards(shard_task(stage, cfg), store, stage, shards, cfg=cfg, fp=fp, target=target,
                                 stage_name=stage, source=list(Source.of(upstream.manifest)))
            results, extra = s.finish(store, fp, cfg, target_ref(target), results) if s.finish else (results, {})
            return finalize(store, handed, results, extra=carry(upstream.manifest, extra))
        return run_stage(cfg, stage, inputs, work)
    return stage_flow



@flow(name="extract", task_runner=StageTaskRunner("extract"))
@no_parameter_schema
def extract_flow(cfg: RunConfig, target: dict, tokenized: StageResult) -> StageResult:
    """Feature shards are checked by size before the stage is reused (hashing terabytes every run
    would cost a full read; train hashes what it reads) and by sha256 when taken from the task
    cache; a bad one drops the manifest and only that shard is recomputed."""
    inputs = _inputs(cfg, "extract", target, tokenized)
    store, handed, _ = reuse(cfg, "extract", inputs)
    drop_manifest_if_damaged(store, handed.fingerprint)

    def work(store, handed):
        fp = handed.fingerprint
        if cfg.extract.mode == "online":  # nothing stored: train computes the features per batch
            return online_manifest(store, handed, cfg, tokenized)
        check_space(cfg, tokenized.manifest, target_ref(target), fp=fp)  # before any shard
        shards = tokenized.manifest.data_shards("train")
        results = map_shards(shard_task("extract", cfg), store, "extract", shards,
                             verify=lambda entries: set(bad_shards(store, fp, entries)),
                             cfg=cfg, fp=fp, target=target, stage_name="extract",
                             source=list(Source.of(tokenized.manifest)))
        return finalize(store, handed, results, extra=carry(tokenized.manifest, {}))
    return run_stage(cfg, "extract", inputs, work)


@contextmanager
def every_core():
    """On CPU, a whole-stage task (train, evaluate) may use every core: the CLI's one thread per task
    (`flows.cli._cpu_threads`) is for shard tasks that run two at a time. Inside, the library's loops measure
    how many of them pay (`draftflow.training.threads`: small ops, or cores another job holds, make one
    thread fastest); the count is restored after. DRAFTFLOW_TORCH_THREADS fixes it instead."""
    import torch

    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


@flow(name="train")
@no_parameter_schema
def train_flow(cfg: RunConfig, target: dict, features: StageResult) -> StageResult:
    inputs = _inputs(cfg, "train", target, features)
    install(run_key(cfg))  # progress and the held-out document reach the UI from a train flow run on its own too

    def work(store, handed):
        with every_core():
            task = T.train_drafter.with_options(tags=device_tags(cfg, "train"))
            return task(cfg=cfg, stamp=handed, target=target, features=feature_source(features))
    result = run_stage(cfg, "train", inputs, work)
    metrics = result.manifest.extra.get("metrics") or {}
    publish_table(cfg, "train", "metrics", metrics_table(metrics),
                  "Final training metrics: loss, tau estimate, accuracy per block position")
    if metrics.get("heldout"):  # the final held-out document (also after torchrun, whose ranks publish nothing live)
        from draftflow.training.heldout import markdown

        progress.document("train", "heldout", markdown(metrics["heldout"], metrics.get("kept_step")))
    return result


@flow(name="evaluate")
@no_parameter_schema
def evaluate_flow(cfg: RunConfig, target: dict, curated: StageResult, trained: StageResult) -> StageResult:
    inputs = _inputs(cfg, "evaluate", target, curated, trained)

    def work(store, handed):
        with every_core():
            task = T.evaluate_drafter.with_options(tags=device_tags(cfg, "evaluate"))
            return task(cfg=cfg, stamp=handed, target=target, curated=curated, trained=trained)
    result = run_stage(cfg, "evaluate", inputs, work)
    return gate_stage(cfg, result, trained)  # also on a reused stage: thresholds are in no fingerprint


def gate_stage(cfg: RunConfig, evaluated: StageResult, trained: StageResult) -> StageResult:
    """Apply `evaluate.gate`: publish its checks, then fail this flow run in one line if it failed."""
    from draftflow.runs.gating import apply_gate, raise_if_failed
    from draftflow.store import Store

    store = Store(cfg.root)
    verdict = apply_gate(store, cfg, evaluated, trained)
    if verdict is not None:
        publish_table(cfg, "evaluate", "gate", verdict["checks"], "evaluate gate: measured value, threshold, passed")
    raise_if_failed(verdict, store)
    return evaluated.model_copy(update={"gate": verdict})
