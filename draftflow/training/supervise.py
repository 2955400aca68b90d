"""The torchrun launcher's child process group: started, streamed to a log, watched, ended.

What a launch needs beyond `subprocess`: its own process group (a cancelled flow run leaves no
trainers), its output copied to the log file and the logger with the last lines kept for the
error message, a hard deadline (`train.timeout_s`), and an end when torchrun's agent outlives a
failed rank (`AGENT_GRACE_S`). Knows nothing of specs, ranks or stores (draftflow.training.launch).
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("draftflow.training.launch")  # the launch's lines, as before this module split off

TAIL_LINES = 20
WATCH_EVERY_S = 2.0  # how often a launch checks its deadline and the ranks' error files
# torchrun's time to exit once a rank failed, before its process group is killed (env DRAFTFLOW_AGENT_GRACE_S)
AGENT_GRACE_S = float(os.environ.get("DRAFTFLOW_AGENT_GRACE_S", "60"))
AGENT_KILLED = -2  # run_streaming's exit code then


def run_streaming(cmd: list[str], log_path: Path, timeout_s: float | None,
                  failed: Callable[[], bool] = lambda: False) -> tuple[int, list[str]]:
    """Run `cmd` in its own process group; copy its output to `log_path` and the logger.

    Returns (exit code, or -1 after a timeout; the last lines). The group is killed on a
    timeout, when the parent is interrupted (a cancelled flow run leaves no trainers), and
    `AGENT_GRACE_S` after `failed()` first holds (a rank wrote its error file): torchrun's agent
    then talks to the rendezvous store, and with that store's node lost or cut off it waits on
    it for minutes (a partitioned link, tests/reliability/test_netns.py).
    """
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default too; 2-core CI would thrash without it
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with open(log_path, "a") as logf:
        logf.write(f"$ {' '.join(cmd)}\n")
        logf.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        reader = threading.Thread(target=_copy_lines, args=(proc.stdout, logf, tail), daemon=True)
        reader.start()
        try:
            rc = _wait(proc, deadline, failed)
        except BaseException:
            kill_group(proc)
            raise
        reader.join(timeout=30)
    return rc, list(tail)


def _wait(proc: subprocess.Popen, deadline: float | None, failed: Callable[[], bool]) -> int:
    """`proc`'s exit code; -1 (group killed) past `deadline`, or `AGENT_GRACE_S` after `failed()`."""
    grace_end = None
    while True:
        try:
            return proc.wait(timeout=WATCH_EVERY_S)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if grace_end is None and failed():
            grace_end = now + AGENT_GRACE_S
        if deadline is not None and now > deadline:
            kill_group(proc)
            return -1
        if grace_end is not None and now > grace_end:
            kill_group(proc)
            return AGENT_KILLED


def _copy_lines(stream, logf, tail) -> None:
    for line in stream:
        logf.write(line)
        logf.flush()
        tail.append(line.rstrip())
        log.info("%s", line.rstrip())


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM torchrun's process group (torchrun forwards it to the ranks), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
