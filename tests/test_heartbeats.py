"""`flows.heartbeats`: a stage subflow's end does not wait on its heartbeat thread; the outermost flow's does.

The flows run for real on Prefect's harness with heartbeats on. Which heartbeat threads the engine starts and
joins is read with `sys.setprofile` in the thread that runs the flows (a sync flow and its subflows run there),
so the test counts calls, never times them.
"""

from __future__ import annotations

import sys
import threading
import time

from prefect import flow

import flows.stages  # noqa: F401  (installs the wrapper, as every process that runs a stage flow does)
from flows import heartbeats


def test_install_is_in_effect_once_flows_are_imported_and_wraps_only_once():
    from prefect import flow_engine

    installed = flow_engine._send_heartbeats
    assert getattr(installed, heartbeats.MARK, False)
    assert heartbeats.install() is True and flow_engine._send_heartbeats is installed


@flow(name="heartbeat-inner")
def inner() -> int:
    return 1


@flow(name="heartbeat-outer")
def outer() -> int:
    return inner() + inner()


def _is_heartbeat(thread: threading.Thread) -> bool:
    args = getattr(thread, "_args", ())
    return bool(args) and getattr(args[0], "__name__", "") == "heartbeat_loop"


def test_subflows_leave_their_heartbeat_threads_unjoined_and_none_outlives_the_outer_flow(prefect_harness):
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    started, joined = [], []

    def watch(frame, event, arg):
        if event == "call" and frame.f_code in (threading.Thread.start.__code__, threading.Thread.join.__code__):
            thread = frame.f_locals.get("self")
            if isinstance(thread, threading.Thread) and _is_heartbeat(thread):
                (started if frame.f_code is threading.Thread.start.__code__ else joined).append(thread)

    with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: 30}):
        sys.setprofile(watch)
        try:
            assert outer() == 2
        finally:
            sys.setprofile(None)
    assert len(started) == 3  # every flow run still beats: the outer one and both subflows
    assert joined == [started[0]]  # only the outer one's end waits on its thread
    end = time.monotonic() + 60  # the others end on their own (within a second, idle): none is left running
    while any(t.is_alive() for t in started) and time.monotonic() < end:
        time.sleep(0.1)
    assert not any(t.is_alive() for t in started)
