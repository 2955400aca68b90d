"""A run's stop request (SIGTERM or SIGINT), and the step boundaries where a loop may be stopped.

The CLI's handler calls `request()` and unwinds the main thread. A loop that can stop cleanly (training:
it writes a checkpoint first) runs inside `stoppable()`. In a worker thread it raises `Interrupted`
between steps once a stop is `requested()`, and the CLI waits (bounded) in `wait_stoppable` for it.
In the main thread (where Prefect runs a task it calls directly) the signal's exception would land
mid-step, so each step runs inside `step_boundary()`: the Python handlers of SIGTERM and SIGINT are
swapped for one that only notes the signal, and the noted signal is handed to the real handler when the
step is done, where the loop can checkpoint. (Masking the signals with `pthread_sigmask` is not enough:
the kernel then delivers them to another thread, and Python still runs the handler in the main thread,
mid-step: a checkpoint could record the weights of step N+1 as step N.) `stopped_at` tells
the CLI where a loop stopped, for its one line.

What it does not know: who handles the signals (the CLI; Prefect during flow runs), or processes.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from draftflow.errors import DraftflowError

_STOP = threading.Event()
_IDLE = threading.Condition()
_active = 0
_graces: list[float] = []  # each active `stoppable` block's grace (how long a stop may wait for it)
_where: list[str] = []
_why: list[str] = []
_stage: list[str] = []


class Interrupted(DraftflowError):
    """A loop in a worker thread stopped at a stop request; its message says where."""


def request(why: str | None = None) -> None:
    """Ask every `stoppable` loop to stop at its next step; `why`: a cause other than a user's signal."""
    if why is not None and not _why:
        _why.append(why)
    _STOP.set()


def requested() -> bool:
    return _STOP.is_set()


def reason() -> str | None:
    """Why the stop was requested, when it was not a user's signal (e.g. the Prefect API was lost)."""
    return _why[0] if _why else None


@contextmanager
def stoppable(grace_s: float | None = None) -> Iterator[None]:
    """A loop that stops between its steps once a stop is `requested()`; `wait_stoppable` waits for it to end.

    `grace_s`: how long a stop may wait for this loop's step in flight (None: as long as the caller allows). A
    loop whose step is long and cheap to redo (a generate call of regenerate: its chunk is not saved) sets it, so
    a stop is not held by it for minutes; training leaves it None (its step ends in a checkpoint worth waiting for).
    """
    global _active
    grace = float("inf") if grace_s is None else grace_s
    with _IDLE:
        _active += 1
        _graces.append(grace)
    try:
        yield
    finally:
        with _IDLE:
            _active -= 1
            _graces.remove(grace)
            _IDLE.notify_all()


def wait_stoppable(timeout: float) -> bool:
    """Wait up to `timeout` seconds (or the longest grace of the blocks running, if shorter) for every `stoppable`
    block to end; whether they all did."""
    with _IDLE:
        limit = min([timeout, max(_graces)]) if _graces else timeout
        return _IDLE.wait_for(lambda: _active == 0, limit)


HELD = (signal.SIGTERM, signal.SIGINT)


@contextmanager
def step_boundary() -> Iterator[None]:
    """In the main thread, note SIGTERM/SIGINT during the block and hand them to their handlers when it ends."""
    if threading.current_thread() is not threading.main_thread():
        yield  # a worker thread's loop checks `requested()` between steps instead
        return
    if any(signal.getsignal(sig) is None for sig in HELD):  # a handler not set from Python: cannot restore it
        yield
        return
    noted: list[tuple[int, object]] = []

    def note(signum: int, frame) -> None:
        if noted:  # a second signal during the step: the real handler now (the CLI's exits at once)
            noted.clear()
            request()
            _deliver(signum, frame, handlers[signum])
            return
        noted.append((signum, frame))

    handlers = {sig: signal.signal(sig, note) for sig in HELD}
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if noted:
            _deliver(*noted[0], handlers[noted[0][0]])


def _deliver(signum: int, frame, handler) -> None:
    """Run `handler` (as Python would have) for a signal noted during a step."""
    if callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_DFL:  # the default action (terminate); SIG_IGN does nothing
        signal.raise_signal(signum)


def stopped(where: str) -> None:
    """Record that a loop stopped at `where` (it unwinds by another exception: the signal's own)."""
    _where.append(where)


def entering(stage: str) -> None:
    """The run starts (or reuses) `stage`: where it stopped, when no loop of that stage says more."""
    _stage[:] = [stage]


def stopped_at() -> str | None:
    """Where the first loop that honoured the request stopped (e.g. "train step 12 of 40"), else the stage the run
    was in (e.g. "tokenize"), if any."""
    return _where[0] if _where else (_stage[0] if _stage else None)
