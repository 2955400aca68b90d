"""`draftflow run` under SIGTERM and SIGINT: stop within seconds, in one line, leaving nothing running.

`interruptible` turns the signals into `RunInterrupted` while the pipeline runs (Prefect swaps in its own
SIGTERM handler during flow runs; it raises `TerminationSignal` and, once its runs are marked crashed,
re-sends the signal to this handler). Training takes the signal between two steps and checkpoints
(`draftflow.interrupt`). The CLI's context managers then release the root's lease and stop the temporary
Prefect server, and `end_interrupted` prints the one line, ends every child process and exits at once
(threads still unwinding are not waited for).

What it does not know: stages or stores; which loops can stop cleanly (`draftflow.interrupt` does).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from pathlib import Path


class RunInterrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT reached `draftflow run`; Prefect marks its runs crashed and lets it through."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


STOP_GRACE_S = 30.0  # how long an interrupted run waits for training to write its checkpoint
BACKSTOP_S = 2.0  # after a signal and the stoppable loops: how long the main thread gets to unwind by itself
UNWIND_S = 5.0  # stop_run, after training stopped: how long the main thread gets to end the run by itself


def interruptible(fn, *args):
    """Run `fn(*args)` with SIGTERM and SIGINT turned into `RunInterrupted` (a second signal exits at once).

    On the first signal every stoppable loop is asked to stop (training checkpoints its step) and logging
    goes quiet (the unwinding Prefect runs would print a traceback each); the wait for those loops is
    bounded by `STOP_GRACE_S`. The caller's context managers then release the lease and stop the server.
    """
    import signal

    from draftflow import interrupt

    received = []

    def on_signal(signum, frame):
        if received:
            os._exit(128 + signum)
        received.append(signum)
        interrupt.request()
        logging.disable(logging.CRITICAL)
        threading.excepthook = lambda hook_args: None
        stop_soon(signum)
        raise RunInterrupted(signum)

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    become_subreaper()
    _ARMED.set()
    try:
        return fn(*args)
    except RunInterrupted as exc:
        interrupt.wait_stoppable(STOP_GRACE_S)
        mark_cancelled(interrupted_line(exc.signum))
        raise
    finally:
        _ARMED.clear()
        for sig, handler in old.items():
            signal.signal(sig, handler)


_ARMED = threading.Event()  # set while `interruptible` runs: the CLI owns the process and may end it
_BACKSTOP: list[threading.Thread] = []


def stop_soon(signum: int) -> None:
    """Under `interruptible`, make sure the run ends in its one line soon after a signal (`_backstop`), whoever
    caught it: this module's handler, or Prefect's during a flow run (`flows.common.map_shards` calls this). Outside
    the CLI (a worker's flow run) it does nothing: Prefect and the worker own that process."""
    if _ARMED.is_set() and not _BACKSTOP:
        _BACKSTOP.append(threading.Thread(target=_backstop, args=(signum,), name="draftflow-stop", daemon=True))
        _BACKSTOP[0].start()


def _backstop(signum: int) -> None:
    """End the run in its one line if unwinding takes longer than the stoppable loops plus `BACKSTOP_S`: Prefect's
    task runner waits for the shard tasks it is running (a curate scan, a tokenize shard), which hold nothing a
    re-run needs (every commit is whole or absent), so they are not waited for."""
    from draftflow import interrupt

    interrupt.wait_stoppable(STOP_GRACE_S)
    time.sleep(BACKSTOP_S)
    if not interrupt.reason():
        mark_cancelled(interrupted_line(signum))
    end_interrupted(RunInterrupted(signum))


def end_interrupted(exc: RunInterrupted) -> None:
    """One line, every child process ended, then exit now (threads still unwinding are not waited for)."""
    from draftflow import interrupt

    if interrupt.reason():  # not a user's signal: the run stopped itself (e.g. flows.apiwatch)
        end_now(stop_line(interrupt.reason()), 2)
    end_now(interrupted_line(exc.signum), 128 + exc.signum)


def interrupted_line(signum: int) -> str:
    """The one line of a run stopped by a user's signal, naming where it stopped."""
    import signal

    from draftflow import interrupt

    where = interrupt.stopped_at()
    at = f" at {where}" if where else ""
    return (f"draftflow: interrupted ({signal.Signals(signum).name}){at}; finished stages and shards are kept: "
            "re-run the same command to resume")


_RUN: list[str] = []  # the top flow run this CLI process runs (`note_run`), to mark Cancelled when interrupted


def note_run() -> None:
    """Remember the flow run in progress as the run's own (the pipeline and refresh flows call it first)."""
    from prefect.runtime import flow_run

    if _ARMED.is_set() and not _RUN and flow_run.id:
        _RUN.append(str(flow_run.id))


def mark_cancelled(line: str, timeout_s: float = 5.0) -> None:
    """Show the interrupted run (and its stage subflows) as Cancelled in the UI, with `line` in its logs, instead of
    Crashed; bounded (`timeout_s`), and silent when the API cannot be reached (the line is printed anyway)."""
    if _RUN:
        worker = threading.Thread(target=_cancel, args=(_RUN[0], line), name="draftflow-cancel", daemon=True)
        worker.start()
        worker.join(timeout_s)


def _cancel(run_id: str, line: str) -> None:
    from datetime import datetime, timezone

    try:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import LogCreate
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
        from prefect.states import Cancelled

        with get_client(sync_client=True) as client:
            runs, parents = [client.read_flow_run(run_id)], [run_id]
            while parents:  # its subflows, and theirs (a deployment's run -> the pipeline -> each stage's flow)
                found = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=parents)))
                runs, parents = runs + found, [str(r.id) for r in found]
            for run in runs:
                if run.state is None or not run.state.is_final() or run.state.is_crashed():
                    client.set_flow_run_state(run.id, Cancelled(message=line), force=True)
            client.create_logs([LogCreate(name="draftflow", level=30, message=line, flow_run_id=run_id,
                                          timestamp=datetime.now(timezone.utc))])
    except Exception:  # noqa: BLE001 - the UI is told when it can be; the run ends in its line regardless
        pass


def on_crashed(flow, flow_run, state) -> None:
    """The `on_crashed` hook of draftflow's top flows: a run stopped by SIGTERM outside the CLI (Prefect cancelling
    a deployment's run, a worker, Kubernetes or systemd stopping it) shows as Cancelled with its one line, as the
    CLI's own runs do (`mark_cancelled`), instead of Crashed. Other crashes are left as they are."""
    import signal

    if _ARMED.is_set() or flow_run.parent_task_run_id is not None or "termination signal" not in (state.message or ""):
        return
    _cancel(str(flow_run.id), interrupted_line(signal.SIGTERM).replace("re-run the same command", "run it again"))


def stop_line(why: str) -> str:
    """The one line of a run that stopped itself for `why`, saying where it stopped (if a loop did)."""
    from draftflow import interrupt

    where = interrupt.stopped_at()
    return (f"draftflow: error: {why}; the run stopped{f' at {where}' if where else ''}; finished stages and "
            "shards are kept: re-run the same command to resume once that is fixed")


def stop_run(why: str) -> None:
    """From a watcher thread: stop the run as a SIGTERM does (training checkpoints its step), then end the
    process in one line naming `why`, without waiting for Prefect's unwinding (which may wait on what was
    lost: the API's retries, a Ray task that no node can run)."""
    import signal

    from draftflow import interrupt

    interrupt.request(why)
    logging.disable(logging.CRITICAL)  # Prefect's client and workers now log each failed call
    os.kill(os.getpid(), signal.SIGTERM)
    interrupt.wait_stoppable(STOP_GRACE_S)
    time.sleep(UNWIND_S)  # the main thread may still end by itself (the same line, from end_interrupted)
    end_now(stop_line(why), 2)


def end_now(line: str, code: int) -> None:
    """Print `line`, release the run's leases, end every child process and exit with `code`, from any thread
    (one that does not wait for the main thread to unwind, e.g. when Prefect's unwinding waits on a lost API)."""
    from draftflow.runlock import release_all

    with _ENDING:
        _last_words(line)
        release_all()
        _end_children()
        os._exit(code)


def _last_words(line: str) -> None:
    """Write `line` to stderr as the last thing this process writes, on a line of its own: stdout and stderr go to
    /dev/null first, so a thread still running (a shard's progress line, CI 2026-12-06) cannot print after it while
    the children end."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    stderr = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    # on a line of its own: a thread may have written the start of a line whose newline now goes to /dev/null
    # (print writes the text, then the newline; CI 2026-12-06 saw "progress: regeneratedraftflow: interrupted ...")
    os.write(stderr, f"\n{line}\n".encode())


_ENDING = threading.Lock()  # one thread ends the process; another that gets here waits for its exit


def _end_children(grace_s: float = 5.0) -> None:
    """SIGTERM every child process of this one (vLLM engines, torchrun), then SIGKILL whatever is still alive below
    this process after `grace_s` (grandchildren too: a vLLM engine core's workers would otherwise wind down on
    their own time once it is gone), and whatever holds a resource tracker's pipe open."""
    import signal

    def below(direct: bool) -> list[int]:
        parent: dict[int, int] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":  # a zombie has exited already
                parent[int(stat.parent.name)] = int(fields[1])
        found, todo = [], [os.getpid()]
        while todo:
            at = todo.pop()
            kids = [p for p, pp in parent.items() if pp == at]
            found += kids
            todo += [] if direct else kids
        return found

    # multiprocessing's resource tracker ignores SIGTERM by design and ends itself, cleaning up, once this process
    # has exited (its pipe closes): neither waited for nor killed (a killed one leaks and complains); what keeps its
    # pipe open is ended instead
    def to_end(pids: list[int]) -> list[int]:
        return [pid for pid in pids if _tracker_fd(pid) is None]

    # the whole tree is read before anything ends: a child that exits first orphans its own children (a vLLM engine
    # core's workers), which are then no longer below this process (CI, 2026-12-06: a worker outlived a run by 3 min)
    tree = below(False)
    _signal_and_wait(to_end(below(True)), signal.SIGTERM, grace_s)
    left = sorted(set(to_end(tree)) | set(to_end(below(False))))
    for _ in range(KILL_SWEEPS):
        _signal_and_wait(left, signal.SIGKILL, grace_s)
        # what was started while these ended: a shard thread inside vLLM's engine start spawns its engine core after
        # the tree was read (2026-12-06: an engine core outlived a run SIGTERMed in regenerate, and the resource
        # tracker with it, its pipe kept open); and what holds a tracker's pipe from outside this tree (CI
        # 2026-12-07: a tracker outlived a run SIGTERMed in regenerate by over 3 min, everything below it gone)
        now = below(False)
        others = to_end(now)
        left = sorted(set(others) | set(_pipe_holders([pid for pid in now if pid not in others])))
        if not left:
            break


def _tracker_fd(pid: int) -> int | None:
    """The fd that `pid` reads its pipe on if it is multiprocessing's resource tracker (`...; main(<fd>)`)."""
    found = re.search(rb"multiprocessing\.resource_tracker import main;main\((\d+)\)", _cmdline(pid))
    return int(found.group(1)) if found else None


def _pipe_holders(trackers: list[int]) -> list[int]:
    """Processes, other than this one and `trackers`, that hold one of the trackers' pipes open. Each got it from
    this process (the pipe is this process's), and a tracker ends only once every one of them has closed it."""
    pipes = set()
    for pid in trackers:
        try:
            pipes.add(os.readlink(f"/proc/{pid}/fd/{_tracker_fd(pid)}"))
        except OSError:
            continue
    holders = []
    for fds in Path("/proc").glob("[0-9]*/fd") if pipes else []:
        pid = int(fds.parent.name)
        if pid == os.getpid() or pid in trackers:
            continue
        try:
            held = list(fds.iterdir())
        except OSError:  # another user's process, or one that exited meanwhile
            continue
        if any(_readlink(fd) in pipes for fd in held):
            holders.append(pid)
    return holders


def _readlink(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:  # closed meanwhile
        return ""


KILL_SWEEPS = 5  # rounds of SIGKILL, each for what the last one left or what was started meanwhile


def _signal_and_wait(pids: list[int], sig: int, wait_s: float) -> None:
    """Send `sig` to each of `pids`, then wait up to `wait_s` for all of them to have exited."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + wait_s
    while pids and time.monotonic() < deadline and any(_exists(pid) for pid in pids):
        time.sleep(0.1)


def become_subreaper() -> None:
    """Make processes orphaned below this one its children instead of init's (Linux `PR_SET_CHILD_SUBREAPER`), so
    `_end_children` still finds a vLLM engine core's workers when the engine core ended first (vLLM's own shutdown
    as the run unwinds). Elsewhere, or where prctl is refused, nothing changes."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # 36 = PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _exists(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
