"""A whole run with its root on s3:// (moto's server on 127.0.0.1): shards, manifests, checkpoints and
Prefect's task results all land in the bucket under the root; nothing lands in a local run folder;
a second run reuses every stage; the credentials appear in no object and no log.

The credentials are distinctive fake values, set in the environment only (where s3fs, in the flow
and in every curate scan process, finds them).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from draftflow.stages.registry import stage_names
from tests.conftest import moto_s3, n_stages, patch_stage, stage_of, tiny_config

KEY_ID = "AKIADRAFTFLOWFAKE7Q3Z"
SECRET = "dfSecret+Fake/9b1e6c27a4f84d0f8e3a5c2b7d9e1f4a"
BUCKET = "draftflow-s3run"
ROOT = f"s3://{BUCKET}/runs/tiny"
STAGES = list(stage_names())  # the registry: the one list of stages
# What a run with a remote root may keep on local disk (see docs/operations.md "Runs on S3"): the built target,
# content-keyed copies of shards it read, train's work folder (checkpoints while training), the target folder's
# fingerprint, keyed by its files' sizes and mtimes, and preflight's answers about it, keyed by its content.
LOCAL_CACHES = {"store", "train-work", "fingerprints", "features", "preflight"}  # features: byte ranges train streamed


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture(scope="module")
def s3_creds(tmp_path_factory):
    """moto's S3 server with distinctive fake credentials, and a fresh local cache to inspect."""
    import s3fs

    with moto_s3(AWS_ACCESS_KEY_ID=KEY_ID, AWS_SECRET_ACCESS_KEY=SECRET,
                 DRAFTFLOW_CACHE=str(tmp_path_factory.mktemp("cache"))):
        s3fs.S3FileSystem().mkdir(BUCKET)
        yield s3fs.S3FileSystem()


def _local_files(folder: Path) -> set[str]:
    return {str(p) for p in folder.rglob("*") if p.is_file()} if folder.exists() else set()


@pytest.fixture(scope="module")
def s3_runs(prefect_harness, s3_creds, tmp_path_factory):
    """Two runs of the tiny pipeline on ROOT, from an empty working directory, with every log kept."""
    from prefect.settings import PREFECT_HOME

    from flows.pipeline import pipeline

    cwd = tmp_path_factory.mktemp("cwd")
    prefect_storage = Path(PREFECT_HOME.value()) / "storage"
    storage_before = _local_files(prefect_storage)
    handler = _Collect()
    loggers = [logging.getLogger(), logging.getLogger("prefect")]
    for lg in loggers:
        lg.addHandler(handler)
    old_cwd, start = os.getcwd(), time.time()
    os.chdir(cwd)
    try:
        first = pipeline(tiny_config(ROOT))
        second = pipeline(tiny_config(ROOT))
    finally:
        os.chdir(old_cwd)
        for lg in loggers:
            lg.removeHandler(handler)
    return {"first": first, "second": second, "cwd": cwd, "logs": handler.lines, "start": start,
            "prefect_storage_new": _local_files(prefect_storage) - storage_before}


def test_every_stage_writes_its_shards_and_manifest_to_the_bucket(s3_runs, s3_creds):
    from draftflow.store import Store

    store = Store(ROOT)
    summary = s3_runs["first"]
    assert [s["status"] for s in summary["stages"]] == ["ran"] * n_stages()
    for s in summary["stages"]:
        assert s["path"].startswith(f"{ROOT}/{s['stage']}/")
        manifest = store.read_manifest(s["stage"], s["fingerprint"])  # exists and every shard verifies by size
        assert manifest is not None and manifest.shards
    assert summary["checkpoint"].startswith(f"{ROOT}/train/")
    assert s3_creds.exists(f"{summary['checkpoint']}/model.safetensors")
    assert s3_creds.exists(f"{ROOT}/run.json")
    # Training copied its checkpoints to the bucket while it ran (a retry elsewhere resumes from
    # them) and removed those copies once the stage was complete.
    train_dir = summary["checkpoint"].rsplit("/", 1)[0]
    assert not s3_creds.exists(f"{train_dir}/work")


def test_prefect_task_results_live_under_the_run_root(s3_runs, s3_creds):
    from draftflow.stages.common import shard_key
    from draftflow.stages.registry import upstream_of
    from draftflow.store import Store

    fps = {s["stage"]: s["fingerprint"] for s in s3_runs["first"]["stages"]}
    manifests = {stage: Store(ROOT).read_manifest(stage, fp) for stage, fp in fps.items()}
    # each shard stage's tasks run over its upstream's shards (the registry's: a worked example's copy puts a stage
    # before tokenize and one after it)
    expected = {shard_key(fps[stage], e.sha256, e.name)
                for stage, split in (("regenerate", "train"), ("tokenize", None), ("extract", "train"))
                for e in manifests[upstream_of(stage)[0]].data_shards(split)}
    stored = {p.rsplit("/", 1)[-1] for p in s3_creds.find(f"{ROOT}/_prefect_results")}
    assert len(expected) >= 6 and expected <= stored  # one record per shard task (plus curate's scans)
    assert not s3_runs["prefect_storage_new"]  # Prefect's local default storage got nothing


def test_nothing_lands_in_a_local_run_folder(s3_runs):
    assert not any(s3_runs["cwd"].iterdir())  # no ./runs/<name>
    cache = Path(os.environ["DRAFTFLOW_CACHE"])
    kept = {p.name for p in cache.iterdir()}
    assert kept - LOCAL_CACHES <= {p.name for p in cache.glob("tiny-*")}  # plus the built tiny target
    features = [p for p in (cache / "store").rglob("*.safetensors") if p.name != "model.safetensors"]
    assert not features  # feature shards were streamed, never downloaded (evaluate downloads the drafter)
    assert list((cache / "features").rglob("*.bin"))


def test_second_run_reuses_every_stage(s3_runs):
    first, second = s3_runs["first"], s3_runs["second"]
    assert [s["status"] for s in second["stages"]] == ["reused"] * n_stages()
    assert second["tau"] == first["tau"] and second["checkpoint"] == first["checkpoint"]


def test_lost_manifest_is_rebuilt_from_task_results_cached_on_s3(s3_runs, s3_creds, monkeypatch):
    """The extract manifest is deleted: the stage runs again, and every shard comes from Prefect's
    cache records in the bucket (no shard is recomputed)."""
    import draftflow.stages.extract as extract_lib
    from flows.pipeline import pipeline

    extract = stage_of(s3_runs["first"], "extract")
    s3_creds.rm(f"{extract['path']}/manifest.json")
    calls: list[str] = []
    real = extract_lib.run_shard
    patch_stage(monkeypatch, "extract", run_shard=lambda *a: calls.append(a[-1].name) or real(*a))
    again = pipeline(tiny_config(ROOT))
    assert [s["stage"] for s in again["stages"] if s["status"] == "ran"] == ["extract"]  # the rest reused
    assert calls == [] and s3_creds.exists(f"{extract['path']}/manifest.json")


def test_credentials_appear_in_no_object_and_no_log(s3_runs, s3_creds):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterTimestamp
    from prefect.types import DateTime

    blobs = [s3_creds.cat_file(p) for p in s3_creds.find(f"{BUCKET}")]
    assert len(blobs) > 20 and any(b'"shards"' in b for b in blobs)  # the scan is not vacuous
    for secret in (KEY_ID, SECRET):
        assert not any(secret.encode() in b for b in blobs), f"{secret[:6]}… found in the bucket"
    api_logs = []
    with get_client(sync_client=True) as client:
        since = LogFilter(timestamp=LogFilterTimestamp(after_=DateTime.fromtimestamp(s3_runs["start"] - 1)))
        while batch := client.read_logs(log_filter=since, offset=len(api_logs), limit=200):
            api_logs += [log.message for log in batch]
        blocks = [b for b in client.read_block_documents() if (b.name or "").startswith("draftflow-results-")]
    assert [b.data for b in blocks if b.data["basepath"] == f"{ROOT}/_prefect_results"] == [
        {"basepath": f"{ROOT}/_prefect_results", "settings": {}}]  # Prefect's database holds no credentials
    logs = "\n".join(s3_runs["logs"] + api_logs)
    assert "curate ran" in logs and "regenerate reused" in logs  # both runs were captured
    for secret in (KEY_ID, SECRET):
        assert secret not in logs
