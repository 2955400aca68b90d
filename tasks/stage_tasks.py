"""One Prefect task per unit of work: a shard of a stage, or a whole small stage.

Shard cache keys come from content only (the stage fingerprint and the input
shard's sha256), so a new flow run of the same command finds finished shards
as Cached; the flow re-runs a cached shard whose file has gone. Retries with
exponential backoff cover transient errors; a `DraftflowError` (bad input the
user must fix) is never retried.
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from draftflow.config import RunConfig
from draftflow.contracts import FeatureSource, Manifest, ShardEntry, ShardResult, StageResult, Stamp
from draftflow.errors import DraftflowError
from draftflow.stages import evaluate, train
from draftflow.stages.common import Source, shard_key
from draftflow.stages.registry import spec
from draftflow.store import USER_CAUSES, Store, storage_cause
from draftflow.target import TargetRef, resolve_target


def _shard_cache_key(context, parameters: dict[str, Any]) -> str:
    return shard_key(parameters["fp"], parameters["shard"].sha256, parameters["shard"].name)


def _transient(task, task_run, state) -> bool:
    """Retry unless the failure is a user error that a retry cannot fix."""
    try:
        state.result()
    except DraftflowError:
        return False
    except Exception as exc:  # a full disk, a denied write or bad credentials: retrying cannot fix them
        return storage_cause(exc) not in USER_CAUSES
    return True


RETRY = dict(retries=2, retry_delay_seconds=exponential_backoff(backoff_factor=2), retry_condition_fn=_transient)
SHARD = dict(cache_key_fn=_shard_cache_key, persist_result=True, **RETRY)
# Whole-stage tasks are not result-cached: their stage manifest is their cache (a cached
# result could outlive the files it describes); train resumes from its own checkpoints.
STAGE = dict(cache_policy=NO_CACHE, **RETRY)


@task(name="prepare-target", cache_policy=NO_CACHE, retries=1)
def prepare_target(cfg: RunConfig) -> dict[str, str]:
    ref = resolve_target(cfg.target)
    return {"path": ref.path, "fingerprint": ref.fingerprint}


@task(name="stage-shard", **SHARD)
def stage_shard(cfg: RunConfig, fp: str, target: dict, stage_name: str, source: list[str],
                shard: ShardEntry) -> ShardResult:
    """One shard of a registry stage with a `run_shard` (flows name it `<stage>-shard` and tag it by device)."""
    return spec(stage_name).run_shard(Store(cfg.root), fp, cfg, TargetRef(**target), Source(*source), shard)


@task(name="train-drafter", **STAGE)
def train_drafter(cfg: RunConfig, stamp: Stamp, target: dict, features: FeatureSource) -> Manifest:
    return train.run(Store(cfg.root), stamp, cfg, TargetRef(**target), features)


@task(name="evaluate-drafter", **STAGE)
def evaluate_drafter(cfg: RunConfig, stamp: Stamp, target: dict, curated: StageResult,
                     trained: StageResult) -> Manifest:
    return evaluate.run(Store(cfg.root), stamp, cfg, TargetRef(**target), curated, trained)
