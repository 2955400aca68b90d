"""A run's stop request: set by the CLI on SIGTERM or SIGINT, honoured by long loops between steps.

The CLI's handler calls `request()` and unwinds its own thread at once; a loop that can stop cleanly
(training: it writes a checkpoint first) runs inside `stoppable()` and calls `check(where)` between
steps, which raises `Interrupted` once a stop is requested. The CLI waits (bounded) in
`wait_stoppable` for such loops to finish, so the re-run resumes from the newest step.

What it does not know: signals, Prefect or processes (the CLI handles those).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from draftflow.errors import DraftflowError

_STOP = threading.Event()
_IDLE = threading.Condition()
_active = 0
_where: list[str] = []


class Interrupted(DraftflowError):
    """A loop stopped at a stop request (`check`); its message says where."""


def request() -> None:
    """Ask every `stoppable` loop to stop at its next step."""
    _STOP.set()


def requested() -> bool:
    return _STOP.is_set()


def reset() -> None:
    """Forget a stop request (a process that runs again after an interrupted run: tests)."""
    _STOP.clear()
    _where.clear()


@contextmanager
def stoppable() -> Iterator[None]:
    """A block that calls `check` between its steps; `wait_stoppable` waits for it to end."""
    global _active
    with _IDLE:
        _active += 1
    try:
        yield
    finally:
        with _IDLE:
            _active -= 1
            _IDLE.notify_all()


def check(where: str) -> None:
    """Raise `Interrupted` ("interrupted at <where>") if a stop was requested; `where` is kept for `stopped_at`."""
    if _STOP.is_set():
        _where.append(where)
        raise Interrupted(f"interrupted at {where}")


def wait_stoppable(timeout: float) -> bool:
    """Wait up to `timeout` seconds for every `stoppable` block to end; whether they all did."""
    with _IDLE:
        return _IDLE.wait_for(lambda: _active == 0, timeout)


def stopped_at() -> str | None:
    """Where the first loop that honoured the request stopped (e.g. "train step 12 of 40"), if any did."""
    return _where[0] if _where else None
