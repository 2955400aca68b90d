"""A run's stop request (SIGTERM or SIGINT), and the step boundaries where a loop may be stopped.

The CLI's handler calls `request()` and unwinds the main thread. A loop that can stop cleanly (training:
it writes a checkpoint first) runs inside `stoppable()`. In a worker thread it raises `Interrupted`
between steps once a stop is `requested()`, and the CLI waits (bounded) in `wait_stoppable` for it.
In the main thread (where Prefect runs a task it calls directly) the signal's exception would land
mid-step, so each step runs inside `step_boundary()`: SIGTERM and SIGINT are held (`pthread_sigmask`)
until the step is done and delivered between steps, where the loop can checkpoint. `stopped_at` tells
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
_where: list[str] = []


class Interrupted(DraftflowError):
    """A loop in a worker thread stopped at a stop request; its message says where."""


def request() -> None:
    """Ask every `stoppable` loop to stop at its next step."""
    _STOP.set()


def requested() -> bool:
    return _STOP.is_set()


@contextmanager
def stoppable() -> Iterator[None]:
    """A loop that stops between its steps once a stop is `requested()`; `wait_stoppable` waits for it to end."""
    global _active
    with _IDLE:
        _active += 1
    try:
        yield
    finally:
        with _IDLE:
            _active -= 1
            _IDLE.notify_all()


def wait_stoppable(timeout: float) -> bool:
    """Wait up to `timeout` seconds for every `stoppable` block to end; whether they all did."""
    with _IDLE:
        return _IDLE.wait_for(lambda: _active == 0, timeout)


HELD = {signal.SIGTERM, signal.SIGINT}


@contextmanager
def step_boundary() -> Iterator[None]:
    """Hold SIGTERM and SIGINT for the block when it runs in the main thread (delivered when it ends)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD)  # a pending signal's handler runs right here


def stopped(where: str) -> None:
    """Record that a loop stopped at `where` (it unwinds by another exception: the signal's own)."""
    _where.append(where)


def stopped_at() -> str | None:
    """Where the first loop that honoured the request stopped (e.g. "train step 12 of 40"), if any did."""
    return _where[0] if _where else None
