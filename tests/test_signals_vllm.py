"""SIGTERM while vLLM runs (vLLM's CPU build; the vLLM leg): in regenerate with its engine up, and in evaluate's
served timings. The run ends in its one line naming the stage, and nothing it started outlives it, vLLM's engine
core and its workers included. The other stages: tests/reliability/test_signals.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.reliability.procs import TINY, alive, code_dir, descendants, described, snapshot_code

pytestmark = pytest.mark.vllm
STOP_S = 60  # a bound for a loaded machine; the times measured are printed (seconds idle)
# How long what the run started may take to go after it exits: vLLM's engine core ends its workers, then itself,
# in seconds idle; in one CI run, beside the reliability leg, it took over 60 s (gone later). A leak never goes.
GONE_S = 180


def _engine_up(pid: int) -> bool:
    """Whether a vLLM engine core runs under `pid` (it names its process VLLM::EngineCore)."""
    for child in descendants(pid):
        try:
            if Path(f"/proc/{child}/comm").read_text().startswith("VLLM::"):
                return True
        except OSError:
            continue
    return False


def _lines(log: Path) -> list[str]:
    return log.read_text(errors="replace").splitlines()


def test_sigterm_while_vllm_regenerates_or_times_the_served_drafter_leaves_nothing_running(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"},
           "PREFECT_HOME": str(tmp_path / "prefect-home"), "CODE_SNAPSHOT": str(snapshot_code(tmp_path / "code"))}
    root = tmp_path / "run"
    sets = [f"root={root}", *TINY, "curate.sources.3.count=8", "regenerate.engine=vllm", "evaluate.engine=vllm",
            "evaluate.ddtree_budgets=[]"]
    cases = [("regenerate", lambda pid, log: _engine_up(pid) and any(x.startswith("progress: regenerate")
                                                                     for x in _lines(log))),
             # regenerate is reused now: the engine that comes up in evaluate is its served timings'
             ("evaluate", lambda pid, log: _engine_up(pid) and any(x.startswith("progress: evaluate")
                                                                   for x in _lines(log)))]
    for stage, ready in cases:
        log = tmp_path / f"{stage}.log"
        with open(log, "w") as fh:
            proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml",
                                     *[f"--set={s}" for s in sets]], cwd=code_dir(env), env=env, stdout=fh,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            end = time.monotonic() + 900
            while not ready(proc.pid, log):
                assert proc.poll() is None, f"{stage}: the run ended first:\n{log.read_text()[-3000:]}"
                assert time.monotonic() < end, f"{stage}: never got there:\n{log.read_text()[-3000:]}"
                time.sleep(0.2)
            started = descendants(proc.pid)
            what = described(started)  # what they were, for the messages below
            os.kill(proc.pid, signal.SIGTERM)
            t0 = time.monotonic()
            try:
                rc = proc.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                pytest.fail(f"{stage}: the run did not exit within {STOP_S} s of SIGTERM")
            took = time.monotonic() - t0
        ours = [x for x in _lines(log) if x.startswith("draftflow: ")]
        assert rc == 128 + signal.SIGTERM, log.read_text()[-3000:]
        assert len(ours) == 1 and ours[0].startswith(f"draftflow: interrupted (SIGTERM) at {stage}"), ours
        end = time.monotonic() + GONE_S
        while alive(started) and time.monotonic() < end:  # vLLM's engine core ends its workers, then itself
            time.sleep(0.2)
        assert not alive(started), f"{stage}: left running: {described(alive(started))} (of {what})"
        print(f"SIGTERM in {stage} (vLLM): exited {took:.1f} s after the signal, nothing left "
              f"{time.monotonic() - t0:.1f} s after it; it had started {what}")
