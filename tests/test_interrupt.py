"""`interrupt.step_boundary`: in the main thread, SIGTERM/SIGINT reach their handler only between steps.

The signals here are real (sent to this process); the handler is a test's own, restored afterwards.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from draftflow import interrupt


class Stop(Exception):
    pass


@pytest.fixture
def handled():
    """A SIGTERM handler that records each call and raises `Stop`; the previous one restored after."""
    calls: list[int] = []

    def handler(signum, frame):
        calls.append(signum)
        raise Stop

    old = signal.signal(signal.SIGTERM, handler)
    yield calls
    signal.signal(signal.SIGTERM, old)
    interrupt._STOP.clear()


def test_a_signal_raised_in_a_step_reaches_its_handler_when_the_step_ends(handled):
    reached_end = False
    with pytest.raises(Stop), interrupt.step_boundary():
        signal.raise_signal(signal.SIGTERM)  # the handler would run before this call returns
        assert handled == []
        reached_end = True
    assert reached_end and handled == [signal.SIGTERM]


def test_a_signal_to_the_process_with_other_threads_alive_still_waits_for_the_step(handled):
    """The kernel hands a process-directed signal to any thread; Python runs the handler in the main one."""
    idle = threading.Event()
    other = threading.Thread(target=idle.wait, daemon=True)
    other.start()
    reached_end = False
    try:
        with pytest.raises(Stop), interrupt.step_boundary():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(50):  # the handler, were it not held, runs at one of these (none may be it)
                time.sleep(0.01)
            assert handled == []
            reached_end = True
    finally:
        idle.set()
    assert reached_end and handled == [signal.SIGTERM]


def test_a_second_signal_in_the_same_step_goes_through_at_once(handled):
    with pytest.raises(Stop), interrupt.step_boundary():
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)
        pytest.fail("the second signal did not reach the handler")
    assert handled == [signal.SIGTERM] and interrupt.requested()


def test_the_handlers_are_restored_and_a_quiet_step_delivers_nothing(handled):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with interrupt.step_boundary():
        assert signal.getsignal(signal.SIGTERM) is not before[0]
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before and handled == []


def test_a_worker_thread_step_is_left_alone(handled):
    seen = []

    def work():
        with interrupt.step_boundary():
            seen.append(signal.getsignal(signal.SIGTERM))

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen == [signal.getsignal(signal.SIGTERM)]
