"""The Prefect API a run reports to: dead at the start, or lost in the middle of training.

A dead PREFECT_API_URL is one line before any work. A server SIGKILLed mid-run is noticed within
DRAFTFLOW_API_LOST_AFTER_S (LOST_AFTER_S here; 30 s by default): the run stops in one line (training
checkpoints the step it is at), leaves no process or lease behind, and a re-run against a new server
resumes from there. Training runs STEPS steps (~30 s idle, longer loaded) so the loss is usually noticed
mid-training; when training has already finished, the stop lands in evaluate and the re-run reuses train.
The re-run is stopped once it says where training resumed (test_kill_points.py resumes runs to their end).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.reliability.procs import (
    alive,
    cli_args,
    finish,
    free_port,
    run_until_line,
    seeded_before,
    snapshot_code,
    start_and_wait_for_training,
    start_prefect_server,
    stop_prefect_server,
)

pytestmark = pytest.mark.reliability

LOST_AFTER_S = 20  # not less: a live server on a loaded machine must never be taken for a lost one
STEPS = 2000
EXIT_S = 120  # the bound on exiting after the kill: LOST_AFTER_S + a poll + a checkpoint, generous under load


@pytest.fixture(scope="module")
def code(tmp_path_factory):
    return snapshot_code(tmp_path_factory.mktemp("code"))


def test_a_dead_api_at_start_is_one_line(code, tmp_path):
    url = f"http://127.0.0.1:{free_port()}/api"  # nothing listens there
    env = {**os.environ, "PREFECT_API_URL": url, "PREFECT_HOME": str(tmp_path / "home")}
    done = subprocess.run([sys.executable, "-m", "flows.cli", *cli_args(str(tmp_path / "run"))], cwd=code,
                          env=env, capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    head = f"draftflow: error: the Prefect API at {url} does not answer"
    assert done.returncode == 2 and lines[-1].startswith(head), done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "PREFECT_API_URL" in lines[-1]
    assert not (tmp_path / "run" / "curate").exists()  # refused before any work


def test_a_server_lost_mid_run_stops_it_in_one_line_and_the_rerun_resumes(code, finished_run, tmp_path):
    server, env = start_prefect_server(tmp_path / "first")
    env = {**env, "CODE_SNAPSHOT": str(code), "DRAFTFLOW_API_LOST_AFTER_S": str(LOST_AFTER_S)}
    root, log = seeded_before("train", tmp_path / "run", finished_run), tmp_path / "run.log"
    try:
        proc, started = start_and_wait_for_training(env, root, log, f"train.max_steps={STEPS}")
    finally:
        stop_prefect_server(server, signal.SIGKILL)  # the server dies (or, without a run, is cleaned up)
    rc, took = finish(proc, EXIT_S)
    out = log.read_text()
    last = out.strip().splitlines()[-1]
    assert rc == 2 and last.startswith(f"draftflow: error: the Prefect API at {env['PREFECT_API_URL']} stopped "
                                       "answering"), out[-3000:]
    assert f"for {LOST_AFTER_S} s" in last and "re-run the same command to resume" in last, last
    assert "Traceback" not in out, out[-3000:]
    assert not alive(started - {server.pid}), f"left running: {alive(started)}"
    assert not (root / ".draftflow-lock.json").exists()
    step = int(last.split("at train step ")[1].split()[0]) if "at train step " in last else None

    again, env2 = start_prefect_server(tmp_path / "second")
    try:  # the re-run's first training line says where it resumed; the rest of its 2000 steps proves nothing more
        rerun = run_until_line({**env2, "CODE_SNAPSHOT": str(code)}, str(root), tmp_path / "rerun.log",
                               "progress: train ", f"train.max_steps={STEPS}")
    finally:
        stop_prefect_server(again)
    if step is not None:  # it resumed at the next step
        first = next(line for line in rerun.splitlines() if line.startswith("progress: train "))
        assert first.startswith(f"progress: train {step + 1}/{STEPS} steps"), first
    elif any(line.split()[:2] == ["train", "reused"] for line in rerun.splitlines()):
        pass  # stopped after training: the re-run reuses it
    else:  # stopped before the first step was checkpointed (a loaded machine: still in train's start-up)
        first = next(line for line in rerun.splitlines() if line.startswith("progress: train "))
        assert first.startswith((f"progress: train 0/{STEPS} ", f"progress: train 1/{STEPS} ")), rerun[-3000:]
    print(f"server lost: the run exited {took:.1f} s after the server was killed, at train step {step}")
