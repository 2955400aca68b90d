"""SIGTERM, Ctrl-C and SIGKILL of `draftflow run` during training, with Prefect's temporary server (no
PREFECT_API_URL): the run stops within a bounded time (STOP_S, generous for a loaded CI machine; seconds
when idle) in one line, leaves no process and no lease behind, and the re-run resumes to an uninterrupted
run's result. Events, not sleeps, decide when a signal is sent: the 2nd training checkpoint on disk.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.reliability.procs import (
    LONG_TRAINING,
    alive,
    cli_args,
    code_dir,
    descendants,
    finish,
    run_to_end,
    run_until_line,
    seeded_before,
    start_and_wait_for,
    start_and_wait_for_training,
    temporary_server_env,
)

pytestmark = pytest.mark.reliability

STEPS = LONG_TRAINING
STOP_S = 60  # SIGTERM/SIGINT to exit, bound (train stops at its next step; the grace for it is 30 s)
LOCK = ".draftflow-lock.json"


@pytest.fixture(scope="module")
def temp_env(tmp_path_factory):
    """The CLI with its own temporary Prefect server (the case that used to outlive the run). Not named `env`: the
    suite's finished run (`finished_run`, session-wide) is made with that one, the shared server's."""
    return temporary_server_env(tmp_path_factory)


@pytest.mark.parametrize("sig, to_group", [(signal.SIGTERM, False), (signal.SIGINT, True)],
                         ids=["sigterm", "ctrl-c to the process group"])
def test_a_signal_during_training_stops_cleanly_and_the_rerun_resumes(sig, to_group, temp_env, finished_run, tmp_path):
    root, log = seeded_before("train", tmp_path / "run", finished_run), tmp_path / "run.log"
    proc, started = start_and_wait_for_training(temp_env, root, log)
    assert started, "the run started no process (its temporary Prefect server at least)"
    (os.killpg if to_group else os.kill)(proc.pid, sig)
    rc, took = finish(proc, STOP_S)
    out = log.read_text()
    assert rc == 128 + sig, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"draftflow: interrupted ({signal.Signals(sig).name}) at train step "), out[-3000:]
    assert "re-run the same command to resume" in last and "Traceback" not in out, out[-3000:]
    assert not alive(started), f"left running after the run ended: {alive(started)}"
    assert not (root / LOCK).exists()
    step = int(last.split("at train step ")[1].split()[0])
    assert any(root.glob(f"train/*/work/checkpoints/step_{step:08d}"))  # the step it stopped at is kept
    # The re-run resumes from that step (that a resumed run equals an uninterrupted one is
    # tests/test_train.py's and test_kill_points.py's to show).
    run_to_end(temp_env, str(root), tmp_path / "rerun.log", STEPS)
    first = next(line for line in (tmp_path / "rerun.log").read_text().splitlines()
                 if line.startswith("progress: train "))
    assert first.startswith(f"progress: train {step + 1}/200 steps"), first  # its first step is the next one
    print(f"{signal.Signals(sig).name}: exited {took:.1f} s after the signal, at train step {step}")


def test_sigterm_during_regenerate_stops_between_batches_and_the_rerun_resumes(temp_env, tmp_path):
    """Regenerate used to keep generating until the stage ended (19 s idle for the tiny run, ~60 s busy; hours on a
    real target, where Kubernetes sends SIGKILL after 30 s). It stops between two batches now: the run ends in one
    line naming the shard and what was saved, and the re-run resumes from the saved chunks."""
    root, log = tmp_path / "run", tmp_path / "run.log"
    # Many short batches, each a few seconds, of ~100 conversations (32 of each training source; all 434 took the
    # re-run 5 min idle, and outlasted run_to_end's 300 s under load on CI, 2026-12-07).
    longer = ("regenerate.max_new_tokens=96", "regenerate.batch_size=2",
              *(f"curate.sources.{i}.count=32" for i in range(4)))
    proc, started = start_and_wait_for(temp_env, root, log, lambda: any(root.glob("regenerate/*/partial/*")),
                                       "regenerate saved a chunk", *longer)
    os.kill(proc.pid, signal.SIGTERM)
    rc, took = finish(proc, STOP_S)
    out = log.read_text()
    assert rc == 128 + signal.SIGTERM, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("draftflow: interrupted (SIGTERM) at regenerate"), out[-3000:]
    # Between two batches ("<shard>, N of M conversations saved"), or, when the batch in flight outlives
    # regenerate.STOP_GRACE_S on a loaded machine, without it (its chunk is redone): either way in one line.
    assert "Traceback" not in out, out[-3000:]
    assert not alive(started), f"left running after the run ended: {alive(started)}"
    assert not (root / LOCK).exists() and not any(root.glob("regenerate/*/manifest.json"))
    assert " ERROR " not in out and "Failed(" not in out, out[-3000:]  # the one line, not a failed task's each
    # The re-run completes regenerate (that a resumed regenerate equals an uninterrupted one, from the saved chunks,
    # is test_regenerate_resume's to show); the stages after it prove nothing more here.
    rerun = run_until_line(temp_env, str(root), tmp_path / "rerun.log", "progress: train ", *longer)
    assert "Traceback" not in rerun and any(root.glob("regenerate/*/manifest.json")), rerun[-3000:]
    print(f"SIGTERM in regenerate: exited {took:.1f} s after the signal ({last})")


def test_sigkill_of_the_run_leaves_no_process(temp_env, finished_run, tmp_path):
    """The temporary server and every child die with a SIGKILLed (or OOM-killed) run; the lease is then
    stale (its holder is gone) and the next run on this host takes it at once."""
    root, log = seeded_before("train", tmp_path / "run", finished_run), tmp_path / "run.log"
    proc, started = start_and_wait_for_training(temp_env, root, log)
    os.kill(proc.pid, signal.SIGKILL)  # the leader only, as the OOM killer does
    proc.wait()
    proc.log_handle.close()
    end = time.monotonic() + STOP_S
    while alive(started) and time.monotonic() < end:
        time.sleep(0.2)
    assert not alive(started), f"outlived the SIGKILLed run: {alive(started)}"


# Where each of the other stages is held mid-work (a kill point that blocks the thread reaching it, as a stage
# that cannot stop by itself would): the signal must still end the run in its one line, naming the stage.
HELD_IN = [("curate", "call:draftflow.stages.curate:merge:1"),
           ("tokenize", "call:draftflow.stages.tokenize:run_shard:1"),
           ("extract", "call:draftflow.stages.extract:run_shard:1"),
           ("evaluate", "call:draftflow.stages.evaluate:load_drafter:1")]


def test_sigterm_in_curate_tokenize_extract_and_evaluate_stops_the_run_in_one_line(temp_env, tmp_path):
    """One root, the stages in order: each re-run takes the stages before from the cache and is stopped inside the
    next. (Train and regenerate: the tests above, which also resume.)"""
    root = tmp_path / "run"
    for stage, point in HELD_IN:
        log, marker = tmp_path / f"{stage}.log", tmp_path / f"{stage}.held"
        cmd = [sys.executable, "-m", "tests.reliability.killable", point, str(marker), "--", *cli_args(str(root))]
        fh = open(log, "w")  # noqa: SIM115 - closed by finish()
        proc = subprocess.Popen(cmd, cwd=code_dir(temp_env), env=temp_env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        proc.log_handle = fh
        end = time.monotonic() + 600
        while not marker.exists():  # the stage is inside its work: an event, not a sleep
            assert proc.poll() is None, f"{stage}: the run ended first:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < end, f"{stage}: never held:\n{log.read_text()[-3000:]}"
            time.sleep(0.05)
        started = descendants(proc.pid)
        os.kill(proc.pid, signal.SIGTERM)
        rc, took = finish(proc, STOP_S)
        out = log.read_text()
        last = out.strip().splitlines()[-1]
        assert rc == 128 + signal.SIGTERM, out[-3000:]
        assert last.startswith(f"draftflow: interrupted (SIGTERM) at {stage};"), out[-3000:]
        assert "Traceback" not in out, out[-3000:]
        end = time.monotonic() + STOP_S  # multiprocessing's resource tracker ends itself once the run has exited
        while alive(started) and time.monotonic() < end:
            time.sleep(0.1)
        assert not alive(started), f"{stage}: left running: {alive(started)}"
        assert not (root / LOCK).exists() and not any(root.glob(f"{stage}/*/manifest.json"))
        print(f"SIGTERM in {stage}: exited {took:.1f} s after the signal")
