"""A training node that stops answering mid-run, for tests/test_multinode.py.

Runs `draftflow.training.launch` (the rank entry point) with one change: the rank blocks forever
in its optimizer step number `DRAFTFLOW_TEST_HANG_AT_STEP` (counted from 1, before the step's first
collective), so the test can SIGKILL the node's processes at a known point, after the previous
checkpoint reached the store, instead of racing a timer.
"""

from __future__ import annotations

import os
import sys
import threading

import draftflow.training.loop as loop
from draftflow.training.launch import main


def hang_at(n: int) -> None:
    """Make this process's `n`-th call of the loop's step function wait forever."""
    real, calls = loop._train_step, []

    def step(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            threading.Event().wait()  # the node "dies" here: the test kills it
        return real(*args, **kwargs)

    loop._train_step = step


if __name__ == "__main__":
    hang_at(int(os.environ["DRAFTFLOW_TEST_HANG_AT_STEP"]))
    sys.exit(main())
