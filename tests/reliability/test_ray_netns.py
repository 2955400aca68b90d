"""A Ray head and worker on two hosts of a real link: the worker cut off, then lost, mid-stage; then a clean re-run.

Host A (tests/reliability/netns.py) runs the Prefect server (on its link address: the worker reports
task runs to it), the Ray head (0 CPUs: it only coordinates) and `draftflow run` itself; host B runs the
only Ray worker node (1 CPU). The tokenize stage's shard tasks go to Ray (`runner.stages=[tokenize]`),
so every one of them runs on host B. A kill point armed in host B's Python processes
(tests/reliability/rayworker/sitecustomize.py) holds the task that commits the first tokenize shard.

1. The link is cut while that task is held. Ray declares host B dead (missed heartbeats) and queues the
   task again, but no alive node has a CPU: after `runner.node_wait_s` the run stops in one line
   (exit 2), leaving no process of its own behind.
2. Link back, host B started again (its raylet ended itself on learning it was declared dead), held at its
   first tokenize commit again and then killed outright (every process): the run again stops in one line.
3. Host B started plainly: the re-run finishes, with manifests and files equal to an uninterrupted run's
   on threads (tests/reliability/conftest.py): the faults lost nothing and duplicated nothing.
The root starts with that run's stages before tokenize (`procs.seeded_before`): the runs begin at the stage on Ray.

Needs root and `ip netns` (skipped elsewhere). About 4 min on 2 cores: three `ray start`s and three CLI runs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.reliability.netns import ADDR, DEADLINE_S, Hosts, two_hosts, wait_listening
from tests.reliability.procs import PREFECT, assert_equals_uninterrupted, cli_args, seeded_before

pytestmark = pytest.mark.reliability
pytest.importorskip("prefect_ray")
RAY = str(Path(sys.executable).parent / "ray")
HEAD = f"{ADDR['a']}:6379"
PREFECT_PORT = 4200
NODE_WAIT_S = 10  # runner.node_wait_s of the disturbed runs
HOLD = "file:tokenize/*/train-*.parquet:1"  # the first tokenize shard each worker process commits
NODE = ["--block", "--disable-usage-stats", "--num-gpus=0", f"--object-store-memory={100 << 20}"]


class Cluster:
    """The Prefect server and the Ray head on host A, the Ray worker node on host B, all from the code snapshot."""

    def __init__(self, hosts: Hosts, tmp: Path, code: Path):
        self.hosts, self.tmp, self.code = hosts, tmp, code
        self.env = {"RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(code)}
        self.ray_tmp = Path(tempfile.mkdtemp(prefix="dfray", dir="/tmp"))  # Ray's socket paths: < 108 bytes
        server = hosts.start("a", [PREFECT, "server", "start", "--host", ADDR["a"], "--port", str(PREFECT_PORT)],
                             tmp / "server.log", PREFECT_HOME=str(tmp / "server-home"),
                             PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_ENABLED="false")
        wait_listening(server, PREFECT_PORT)
        head = [RAY, "start", "--head", "--port=6379", "--num-cpus=0", f"--node-ip-address={ADDR['a']}",
                "--include-dashboard=false", f"--temp-dir={self.ray_tmp / 'a'}", *NODE]
        # Ray declares a silent node dead after 5 missed health checks, each waiting up to 10 s by default: 3 s
        # here (~30 s in all). A node that answers within 3 s on a loaded machine is never taken for a lost one.
        head = hosts.start("a", head, tmp / "head.log", cwd=code, RAY_health_check_timeout_ms="3000", **self.env)
        wait_listening(head, 6379)

    def start_worker(self, name: str, hold: bool) -> Path:
        """Start host B's worker node (its kill point armed with `hold`); return the marker the held task writes."""
        marker = self.tmp / f"{name}.held"
        armed = {"KILLABLE_POINT": HOLD, "KILLABLE_ROOT": str(self.tmp / "run"), "KILLABLE_MARKER": str(marker)}
        env = {**self.env, "PYTHONPATH": f"{self.code}:{self.code / 'tests/reliability/rayworker'}"}
        cmd = [RAY, "start", f"--address={HEAD}", "--num-cpus=1", f"--node-ip-address={ADDR['b']}",
               f"--temp-dir={self.ray_tmp / 'b'}", *NODE]
        self.hosts.start("b", cmd, self.tmp / f"{name}-worker.log", cwd=self.code, **env, **(armed if hold else {}))
        deadline = time.monotonic() + DEADLINE_S
        while self._alive_nodes() < 2:
            assert time.monotonic() < deadline, (self.tmp / f"{name}-worker.log").read_text()[-3000:]
            time.sleep(0.5)  # polling a condition
        return marker

    def _alive_nodes(self) -> int:
        run = subprocess.run(["ip", "netns", "exec", self.hosts.ns["a"], RAY, "status", f"--address={HEAD}"],
                             capture_output=True, text=True, timeout=120, env=os.environ | self.env)
        active = run.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0] if "Active:" in run.stdout else ""
        return len(re.findall(r"^\s*\d+ node_", active, re.MULTILINE))

    def run(self, name: str) -> subprocess.Popen:
        """`draftflow run` (the reliability suite's tiny run) on host A, tokenize's tasks on Ray."""
        args = cli_args(str(self.tmp / "run"), "runner.kind=ray", f"runner.ray_address={HEAD}",
                        "runner.stages=[tokenize]", "runner.gpus_per_task=0", f"runner.node_wait_s={NODE_WAIT_S}")
        return self.hosts.start("a", [sys.executable, "-m", "flows.cli", *args], self.tmp / f"{name}.log",
                                cwd=self.code, PREFECT_API_URL=f"http://{ADDR['a']}:{PREFECT_PORT}/api",
                                PREFECT_HOME=str(self.tmp / "client-home"), **self.env)


def _wait_for(marker: Path, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.1)  # polling a condition


def _in_session(sid: int, pids: list[int]) -> list[int]:
    """The processes of `pids` in session `sid` (a run's: it was started as a session leader)."""
    found = []
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it exited meanwhile
        if int(fields[3]) == sid:  # state, ppid, pgrp, session
            found.append(pid)
    return found


def _stopped_in_one_line(proc: subprocess.Popen, log: Path) -> str:
    rc = proc.wait(timeout=DEADLINE_S)
    text = log.read_text()
    last = text.strip().splitlines()[-1]
    assert rc == 2 and "Traceback" not in text, text[-4000:]
    assert last.startswith("draftflow: error: tokenize: no alive Ray node could run a task (1 CPU) for "
                           f"runner.node_wait_s={NODE_WAIT_S} s"), text[-4000:]
    return last


def test_a_ray_worker_cut_off_then_lost_stops_in_one_line_and_the_rerun_equals_a_clean_run(env, uninterrupted,
                                                                                           finished_run, tmp_path):
    _, (want_manifests, want_files) = uninterrupted
    code = Path(env["CODE_SNAPSHOT"])
    seeded_before("tokenize", tmp_path / "run", finished_run)  # the runs start at tokenize, the stage on Ray
    with two_hosts() as hosts:
        cluster = Cluster(hosts, tmp_path, code)

        # 1. Host B's link is cut while it holds a tokenize task.
        held = cluster.start_worker("cut", hold=True)
        run = cluster.run("cut")
        _wait_for(held, run, tmp_path / "cut.log")
        hosts.link(up=False)
        _stopped_in_one_line(run, tmp_path / "cut.log")
        assert _in_session(run.pid, hosts.pids("a")) == [], "the stopped run left processes behind"
        hosts.link(up=True)
        hosts.kill("b")

        # 2. Host B again, lost outright (every process killed) while it holds a tokenize task.
        held = cluster.start_worker("lost", hold=True)
        run = cluster.run("lost")
        _wait_for(held, run, tmp_path / "lost.log")
        hosts.kill("b")
        _stopped_in_one_line(run, tmp_path / "lost.log")
        assert _in_session(run.pid, hosts.pids("a")) == [], "the stopped run left processes behind"

        # 3. Host B again, nothing held: the re-run finishes.
        cluster.start_worker("clean", hold=False)
        run = cluster.run("clean")
        assert run.wait(timeout=DEADLINE_S) == 0, (tmp_path / "clean.log").read_text()[-4000:]
    shutil.rmtree(cluster.ray_tmp, ignore_errors=True)
    root = tmp_path / "run"
    assert_equals_uninterrupted(root, want_manifests, want_files)
