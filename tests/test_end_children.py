"""`flows.signals._end_children`, as a stopped run calls it: a child that exits at SIGTERM at once, or before, orphans
its own children (a vLLM engine core's workers); they are still ended (CI, 2026-12-06: a worker outlived a run by
over 3 min)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flows.signals import _exists as _running

ROOT = Path(__file__).resolve().parents[1]

# the child: starts a grandchild that ignores SIGTERM, says its pid, then waits (SIGTERM ends it at once)
CHILD = textwrap.dedent("""
    import subprocess, sys, time
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(600)"
    grandchild = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    grandchild.stdout.readline()
    print(grandchild.pid, flush=True)
    time.sleep(600)
""")

# the run (as `draftflow run` arms it: a subreaper): starts the child, reads the grandchild's pid, lets the child
# end first when told (as vLLM's own shutdown ends its engine core), ends its children as a stopped run does
RUN = textwrap.dedent(f"""
    import subprocess, sys
    from flows.signals import _end_children, become_subreaper
    become_subreaper()
    child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], stdout=subprocess.PIPE)
    grandchild = int(child.stdout.readline())
    if sys.argv[1] == "child-ends-first":
        child.terminate()
        child.wait()
    _end_children(grace_s=2.0)
    print(grandchild, flush=True)
""")


@pytest.mark.parametrize("when", ["child-ends-at-sigterm", "child-ends-first"])
def test_a_grandchild_orphaned_by_its_parent_exiting_is_ended_too(when):
    out = subprocess.run([sys.executable, "-c", RUN, when], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    grandchild = int(out.stdout.split()[-1])
    try:
        end = time.monotonic() + 30  # SIGKILLed already: only its reaping is waited for
        while _running(grandchild) and time.monotonic() < end:
            time.sleep(0.1)
        assert not _running(grandchild), "the grandchild that ignores SIGTERM outlived the run"
    finally:
        if _running(grandchild):
            os.kill(grandchild, signal.SIGKILL)


# the run starts multiprocessing's resource tracker, then a process that holds the tracker's pipe and escapes the run's
# tree (it forks and its parent exits; no subreaper catches it): the tracker ends only once every holder has closed
# the pipe, so the run ends the holder (CI, 2026-12-07: a tracker outlived a run in regenerate, its tree all gone)
ESCAPES = textwrap.dedent("""
    import subprocess, sys
    from multiprocessing import resource_tracker
    from flows.signals import _end_children
    resource_tracker.ensure_running()
    tracker = resource_tracker._resource_tracker
    code = "import os, time; os.fork() and os._exit(0); print(os.getpid(), flush=True); time.sleep(600)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, pass_fds=[tracker._fd],
                             stderr=subprocess.DEVNULL)
    holder = int(child.stdout.readline())
    child.wait()
    _end_children(grace_s=2.0)
    print(holder, tracker._pid, flush=True)
""")


def test_a_process_that_escaped_the_run_holding_the_resource_trackers_pipe_is_ended_and_the_tracker_ends():
    out = subprocess.run([sys.executable, "-c", ESCAPES], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    holder, tracker = map(int, out.stdout.split()[-2:])
    try:
        end = time.monotonic() + 60  # the tracker ends once the pipe's last holder is gone; only that is waited for
        while (_running(holder) or _running(tracker)) and time.monotonic() < end:
            time.sleep(0.1)
        assert not _running(holder), "the process holding the tracker's pipe outlived the run"
        assert not _running(tracker), "the resource tracker outlived the run"
    finally:
        for pid in (holder, tracker):
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


# a run whose shard thread keeps printing progress while it is ended (its child ignores SIGTERM, so ending it takes
# the whole grace): nothing the process writes comes after the one line
ENDS = textwrap.dedent("""
    import subprocess, sys, threading, time
    from flows.signals import end_now
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(600)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    child.stdout.readline()

    def chatter():
        while True:
            print("progress: regenerate", file=sys.stderr, flush=True)
            print("a result", flush=True)
            time.sleep(0.01)

    threading.Thread(target=chatter, daemon=True).start()
    time.sleep(0.2)
    end_now("draftflow: interrupted (SIGTERM); re-run the same command to resume", 143)
""")


def test_the_one_line_is_the_last_thing_a_run_that_is_ended_writes():
    out = subprocess.run([sys.executable, "-c", ENDS], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 143, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith("draftflow: interrupted (SIGTERM)"), out.stderr[-2000:]
    assert out.stderr.count("draftflow: interrupted") == 1 and "progress: regenerate" in out.stderr
    assert "a result" in out.stdout


def test_the_one_line_starts_a_line_of_its_own_after_a_line_left_unfinished():
    # a thread's print writes its text, then its newline: ending between the two left the one line glued to the text
    code = ("import sys; from flows.signals import end_now\n"
            "sys.stderr.write('progress: regenerate'); sys.stderr.flush()\n"
            "end_now('draftflow: interrupted (SIGTERM); re-run the same command to resume', 143)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 143, out.stderr[-2000:]
    assert out.stderr.splitlines() == ["progress: regenerate", "draftflow: interrupted (SIGTERM); re-run the same "
                                       "command to resume"], out.stderr
