"""A stage's shard tasks on a real two-node Ray cluster, started as on two machines.

A head (`ray start --head`, 0 CPUs: it only coordinates, as on a real cluster) and one worker node
(`ray start --address=<head>`, 1 CPU) run on this machine, each its own `ray start --block` process
with its own ports, all chosen free. A task asks for 1 CPU, which only the worker node has, so every
shard task that runs on the cluster runs on the worker node. The tokenize stage of the tiny run on
the cluster (`runner.kind=ray`, `runner.ray_address=<head>`) writes the same shards and manifest as
on the thread runner.

Not Ray's local mode (`ray.init()` in the test process, tests/test_ray.py): the cluster is joined by
address, like `draftflow run --set runner.ray_address=head:6379` on a real one. The cluster is
stopped by signalling the two `ray start --block` processes this fixture started (each then stops
the processes it started) and killing what is left of their process groups. Not `ray stop`: it
kills every Ray process of the user on the machine, including another test session's.

Slow, up to 3 min (65 s and 2 min 47 s in two runs on 2 cores shared with other sessions), because
it starts what a real cluster runs: Prefect's test harness (20-35 s, shared by the session), two Ray
nodes (each its GCS or raylet, ~12 s per `ray start` here), a Ray worker process that imports torch and
transformers, and curate, regenerate and tokenize twice (threads, then Ray) as real flows.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, tiny_config
from tests.ray_auth import own_ray_token, reload_ray_auth

pytest.importorskip("prefect_ray")
DEADLINE_S = 300  # generous: a loaded 2-core machine; nothing asserts that it is met quickly
RAY = str(Path(sys.executable).parent / "ray")
NODE = [
    "--block",
    "--disable-usage-stats",
    "--node-ip-address=127.0.0.1",
    "--num-gpus=0",
    f"--object-store-memory={100 << 20}",
]  # tasks pass small manifests, never data


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], log: Path) -> subprocess.Popen:
    env = os.environ | {"RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}
    with open(log, "a") as out:
        return subprocess.Popen(
            [RAY, "start", *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )  # its own process group: stopped by id, nothing else


def _alive_nodes(address: str) -> int:
    """Alive nodes as `ray status` lists them (0 while the cluster cannot answer yet)."""
    run = subprocess.run([RAY, "status", f"--address={address}"], capture_output=True, text=True, timeout=120)
    if run.returncode != 0 or "Active:" not in run.stdout:
        return 0
    active = run.stdout.split("Active:", 1)[1].split("Pending:", 1)[0]
    return len(re.findall(r"^\s*\d+ node_", active, re.MULTILINE))


def _wait_nodes(address: str, n: int, procs: list[subprocess.Popen], log: Path) -> bool:
    """True once the cluster lists `n` alive nodes; False if a `ray start` exits first."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            return False
        if _alive_nodes(address) >= n:
            return True
        time.sleep(0.5)  # polling a condition, not waiting a fixed time
    raise AssertionError(f"the Ray cluster at {address} never listed {n} nodes; see {log}")


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each `ray start --block` (it stops its node's processes), then SIGKILL its group's leftovers."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


@pytest.fixture(scope="module")
def ray_token():
    """Token authentication with a token of this test's own, in this process (the driver) and every
    node's environment (on real nodes: the same RAY_AUTH_TOKEN everywhere). Reloaded into this process:
    it caches the token it read first, e.g. for tests/test_ray.py's local instance (tests/ray_auth.py)."""
    pytest.importorskip("ray")
    with own_ray_token() as token:
        yield token


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory, ray_token):
    """A head and one worker node; yields the head's address (host:port)."""
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized()
    tmp = tmp_path_factory.mktemp("ray")  # Ray's session folder (its socket paths must stay under 108 chars)
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(5):  # a free port can be taken before the head binds it: then try another
            address = f"127.0.0.1:{_free_port()}"
            head = _start(
                [
                    "--head",
                    f"--port={address.split(':')[1]}",
                    "--num-cpus=0",
                    f"--temp-dir={tmp}",
                    "--include-dashboard=false",
                    f"--ray-client-server-port={_free_port()}",
                    f"--dashboard-agent-listen-port={_free_port()}",
                    *NODE,
                ],
                tmp / "head.log",
            )
            procs.append(head)
            if _wait_nodes(address, 1, [head], tmp / "head.log"):
                break
        else:
            raise AssertionError(f"no Ray head started; see {tmp / 'head.log'}")
        procs.append(
            _start(
                [f"--address={address}", "--num-cpus=1", f"--dashboard-agent-listen-port={_free_port()}", *NODE],
                tmp / "worker.log",
            )
        )
        assert _wait_nodes(address, 2, procs[-2:], tmp / "worker.log"), (tmp / "worker.log").read_text()[-3000:]
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        _stop(list(reversed(procs)))


def _tokenize(cfg):
    """The stages before tokenize on threads, then tokenize as `cfg.runner` says; returns tokenize's stage result."""
    from draftflow.stages.registry import needed
    from flows.pipeline import run_stage_flow
    from tasks.stage_tasks import prepare_target

    target, results = prepare_target.fn(cfg), {}
    for stage in needed("tokenize"):  # from the registry: a worked example's copy has a stage before tokenize
        results[stage] = run_stage_flow(stage, cfg, target, results)
    return results["tokenize"]


def test_tokenize_on_a_two_node_ray_cluster_equals_the_thread_runner(prefect_harness, ray_cluster, tmp_path):
    import ray

    from draftflow.stages.common import manifest_digest
    from draftflow.store import Store

    runs = {}
    for name, extra in (
        ("threads", []),
        (
            "ray",
            [
                "runner.kind=ray",
                f"runner.ray_address={ray_cluster}",
                "runner.stages=[tokenize]",
                "runner.gpus_per_task=0",
            ],
        ),
    ):
        cfg = tiny_config(tmp_path / name, *extra)
        result = _tokenize(cfg)
        assert result.status == "ran"
        m = Store(cfg.root).read_manifest("tokenize", result.fingerprint)
        runs[name] = (result.fingerprint, manifest_digest(m), sorted((e.name, e.sha256) for e in m.shards))
    assert runs["ray"] == runs["threads"] and len(runs["ray"][2]) >= 2
    if not ray.is_initialized():
        ray.init(address=ray_cluster)
    assert _task_kinds(ray, "task::tokenize-shard") == {"task::tokenize-shard"}  # ran on the cluster (worker node)


def _task_kinds(ray, expected: str) -> set[str]:
    """Kinds of Prefect tasks the cluster has run (its timeline: workers report about once a second)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        kinds = {e["cat"] for e in ray.timeline() if str(e.get("cat", "")).startswith("task::")}
        if expected in kinds or time.monotonic() > deadline:
            return kinds
        time.sleep(0.5)


def test_a_wrong_auth_token_is_one_line_that_says_what_to_set(ray_cluster, tmp_path):
    """The cluster runs with this module's token; this process presents another one. Ray says only
    "Failed to connect to Ray cluster at <ip>:<port>" (the cause is in its exception chain): the
    ConfigError names the token and what to set. About 20 s: Ray retries the GCS connection."""
    import ray

    from draftflow.errors import ConfigError
    from flows.runners import connect_ray

    ray.shutdown()  # the test above leaves this process connected (a no-op when it is not)
    address = f"runner.ray_address={ray_cluster}"
    cfg = tiny_config(tmp_path / "run", "runner.kind=ray", address, "runner.gpus_per_task=0")
    good = os.environ["RAY_AUTH_TOKEN"]
    os.environ["RAY_AUTH_TOKEN"] = "0" * 64
    reload_ray_auth()
    try:
        with pytest.raises(ConfigError, match=r"rejected this process's auth token; set RAY_AUTH_MODE=token") as err:
            connect_ray(cfg.runner, gpu_tasks=False)
    finally:
        os.environ["RAY_AUTH_TOKEN"] = good
        reload_ray_auth()
    assert "\n" not in str(err.value) and f"runner.ray_address='{ray_cluster}'" in str(err.value)
    assert not ray.is_initialized()
