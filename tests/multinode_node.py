"""A training node that stops answering mid-run, for tests/test_multinode.py.

Runs `draftflow.training.launch` (the rank entry point) with one change: the rank blocks forever
in its optimizer step number `DRAFTFLOW_TEST_HANG_AT_STEP` (counted from 1, before the step's first
collective), so the test can SIGKILL the node's processes at a known point, after the previous
checkpoint reached the store, instead of racing a timer. With `DRAFTFLOW_TEST_HOLD_UNTIL` (a path)
the rank waits there only until that file exists, then goes on into the step's collectives
(tests/reliability/test_netns.py cuts the link between the nodes meanwhile).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import draftflow.training.loop as loop
from draftflow.training.launch import main


def hang_at(n: int, until: str | None = None) -> None:
    """Make this process's `n`-th call of the loop's step function wait forever, or until `until` exists."""
    real, calls = loop._train_step, []

    def step(*args, **kwargs):
        calls.append(1)
        if len(calls) == n and until is None:
            threading.Event().wait()  # the node "dies" here: the test kills it
        while len(calls) == n and not Path(until).exists():
            time.sleep(0.2)  # polling the test's signal to go on
        return real(*args, **kwargs)

    loop._train_step = step


if __name__ == "__main__":
    hang_at(int(os.environ["DRAFTFLOW_TEST_HANG_AT_STEP"]), os.environ.get("DRAFTFLOW_TEST_HOLD_UNTIL"))
    sys.exit(main())
