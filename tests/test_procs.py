"""The process helpers the signal and kill tests count leftovers with (`tests/reliability/procs.py`)."""

from __future__ import annotations

import os
import subprocess

from tests.reliability import procs


def test_alive_counts_a_found_pid_only_while_it_is_the_same_process():
    """pid_max is 32,768 here: within a CI run an id comes back as another process, which is not a leftover."""
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert child.pid in procs.descendants(os.getpid())
        assert procs.alive({child.pid}) == {child.pid}
        procs._FOUND_STARTED[child.pid] = "0"  # as if the process found had ended and its id been given out again
        assert procs.alive({child.pid}) == set()
    finally:
        child.kill()
        child.wait()
    assert procs.alive({child.pid}) == set()
