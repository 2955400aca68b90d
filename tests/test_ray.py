"""Shard tasks on Ray: a real local Ray instance, real Prefect flows, no mocks.

The instance is started here with 2 CPUs and 2 *declared* GPUs (Ray schedules by declared
resources, so the GPU request path is exercised on a CPU machine: a `gpu` task gets one and
Ray sets its CUDA_VISIBLE_DEVICES). Errors of the runner section are checked first, before
any Ray instance is up.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prefect import flow, task

from draftflow.config import RunConfig
from draftflow.errors import ConfigError
from draftflow.stages.registry import stage_names
from flows.runners import StageTaskRunner, connect_ray, gpu_shortfall, task_runner_for
from tests.conftest import n_stages, tiny_config
from tests.ray_auth import own_ray_token

pytest.importorskip("prefect_ray")
RAY = ["runner.kind=ray", "runner.stages=[curate,regenerate,tokenize,extract]"]


def test_runner_section_is_in_no_fingerprint(tmp_path):
    from draftflow.stages.registry import stamp

    base = tiny_config(tmp_path / "run")
    moved = tiny_config(tmp_path / "run", *RAY, "runner.ray_address=ray://head:10001", "runner.gpus_per_task=2",
                        "runner.max_workers=3")
    for stage in stage_names():
        assert stamp(base, stage, {"x": "1"}).fingerprint == stamp(moved, stage, {"x": "1"}).fingerprint


def test_ray_without_prefect_ray_installed_says_what_to_install(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "prefect_ray", None)  # what a missing package looks like to import
    cfg = tiny_config(tmp_path / "run", "runner.kind=ray")
    with pytest.raises(ConfigError, match=r"pip install 'draftflow\[ray\]'") as err:
        task_runner_for(cfg, "extract")
    assert "\n" not in str(err.value)


def test_unreachable_ray_address_is_one_line(tmp_path):
    import ray

    assert not ray.is_initialized()
    with socket_closed_port() as port:
        cfg = tiny_config(tmp_path / "run", "runner.kind=ray", f"runner.ray_address=ray://127.0.0.1:{port}")
        with pytest.raises(ConfigError, match=rf"runner.ray_address='ray://127.0.0.1:{port}' is unreachable") as err:
            connect_ray(cfg.runner)
    assert "\n" not in str(err.value) and not ray.is_initialized()


def test_gpu_requests_that_no_node_can_meet_are_named():
    from draftflow.config import RunnerConfig

    assert gpu_shortfall(RunnerConfig(gpus_per_task=0), 0) is None
    assert gpu_shortfall(RunnerConfig(gpus_per_task=2), 4) is None
    assert "runner.gpus_per_task=1 but the Ray cluster has 0 GPUs" in gpu_shortfall(RunnerConfig(), 0)


def test_tensor_parallel_group_must_fit_in_one_task(tmp_path):
    cfg = tiny_config(tmp_path / "run", "runner.kind=ray", "regenerate.engine=vllm",
                      "regenerate.vllm.tensor_parallel_size=2")
    with pytest.raises(ConfigError, match="regenerate.vllm.tensor_parallel_size=2"):
        task_runner_for(cfg, "regenerate")


class socket_closed_port:
    """A localhost port nothing listens on (bound, then closed)."""

    def __enter__(self) -> int:
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        return port

    def __exit__(self, *exc) -> None:
        return None


@pytest.fixture(scope="module")
def ray_instance():
    """A local instance with a token of its own (tests/ray_auth.py): not the user's ~/.ray/auth_token (which
    `ray.init()` would otherwise write), and not a token an earlier module left cached in this process."""
    ray = pytest.importorskip("ray")
    with own_ray_token():
        ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, object_store_memory=200 << 20, namespace="prefect")
        try:
            yield ray
        finally:
            ray.shutdown()


@task(name="probe", tags=["gpu"])
def probe_gpu(shard: int) -> dict:
    return _where()


@task(name="probe-cpu")
def probe_cpu(shard: int) -> dict:
    return _where()


def _where() -> dict:
    import ray
    import torch

    import draftflow
    import flows
    import tasks

    in_worker = ray.get_runtime_context().worker.mode == ray.WORKER_MODE
    return {"pid": os.getpid(), "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
            "resources": ray.get_runtime_context().get_assigned_resources() if in_worker else {},
            "packages": [m.__file__ for m in (draftflow, flows, tasks)]}


@flow(name="probe-extract", task_runner=StageTaskRunner("extract"))
def probe_flow(cfg: RunConfig) -> list[dict]:
    return [f.result() for f in probe_gpu.map([0, 1])] + [f.result() for f in probe_cpu.map([0])]


def test_gpu_tasks_ask_ray_for_gpus_and_workers_import_the_repo_with_one_torch_thread(
        prefect_harness, ray_instance, tmp_path):
    out = probe_flow(tiny_config(tmp_path / "run", "runner.kind=ray"))
    repo = str(Path(__file__).resolve().parent.parent)
    for where in out:
        assert where["pid"] != os.getpid()  # ran in a Ray worker, not in the flow's thread pool
        assert where["threads"] == 1 and where["omp"] == "1"
        assert all(p.startswith(repo) for p in where["packages"])  # the editable install of this tree
    assert [w["resources"].get("GPU", 0) for w in out] == [1.0, 1.0, 0]
    assert all(w["resources"]["CPU"] == 1.0 for w in out)


def test_thread_runner_stays_in_the_flow_process(prefect_harness, tmp_path):
    out = probe_flow.with_options(name="probe-thread")(tiny_config(tmp_path / "run"))
    assert {w["pid"] for w in out} == {os.getpid()}


def test_pipeline_on_ray_writes_the_same_manifests_as_on_threads(prefect_harness, ray_instance, tmp_path):
    """GPU-stage shards on Ray (as CPU tasks here: a GPU task gets a fresh worker each time, see
    the README) give byte-identical shards and manifests; train/evaluate compare by model and tau
    (their metrics hold throughput)."""
    from draftflow.stages.common import manifest_digest
    from draftflow.store import Store, sha256_file
    from flows.pipeline import pipeline

    runs, tau, model = {}, {}, {}
    for name, extra in (("threads", []), ("ray", ["runner.kind=ray", "runner.gpus_per_task=0"])):
        cfg = tiny_config(tmp_path / name, *extra)
        summary = pipeline(cfg)
        assert [s["status"] for s in summary["stages"]] == ["ran"] * n_stages()
        store = Store(cfg.root)
        manifests = [(s, store.read_manifest(s["stage"], s["fingerprint"])) for s in summary["stages"][:4]]
        runs[name] = [(s["stage"], s["fingerprint"], manifest_digest(m),
                       sorted((e.name, e.sha256) for e in m.shards)) for s, m in manifests]
        tau[name], model[name] = summary["tau"], sha256_file(Path(summary["checkpoint"]) / "model.safetensors")
    assert runs["ray"] == runs["threads"] and all(r[3] for r in runs["ray"])
    assert model["ray"] == model["threads"] and tau["ray"] == tau["threads"]
    assert _ray_task_kinds(ray_instance, {"task::regenerate-shard", "task::extract-shard"}) == {
        "task::regenerate-shard", "task::extract-shard"}  # GPU-stage shards ran on Ray; tokenize did not


def _ray_task_kinds(ray, expected: set[str], wait_s: float = 300.0) -> set[str]:
    """Kinds of Prefect tasks Ray has run (its timeline, reported by workers about once a second); returns as
    soon as `expected` are in, so the generous deadline costs nothing unless they never come (a loaded machine)."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        kinds = {e["cat"] for e in ray.timeline() if str(e.get("cat", "")).startswith("task::")}
        if expected <= kinds or time.monotonic() > deadline:
            return kinds - {"task::probe", "task::probe-cpu"}
        time.sleep(0.5)
