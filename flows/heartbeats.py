"""Stage subflows that end without waiting on their heartbeat thread.

Why: against a Prefect server every flow run sends heartbeats (`PREFECT_FLOWS_HEARTBEAT_FREQUENCY`, 180 s by
default in Prefect 3.9) from a thread of its own, which sleeps in one-second steps. Prefect's synchronous engine
joins that thread when the run ends, so each flow run's end waits for the thread's current second to run out
(~0.65 s on average). A draftflow run is seven flow runs (the pipeline, then a subflow per stage): a run whose
stages are all reused spent ~5 of its ~20 s there (cProfile of `draftflow run`, 2026-12-07), and every run that
resumes pays it once per stage it reuses. Prefect's asynchronous engine already leaves the thread unjoined.

What it does: `install()` (run when `flows.stages` is imported, so by every process that runs draftflow's stage
flows, a worker's flow-run processes included) wraps Prefect's heartbeat context so that a subflow's run (one with a
parent task run) does not join its thread; the outermost flow run still does, so no heartbeat thread outlives the
process's last flow run by more than a second. The thread is a daemon that checks its stop event before each
beat and each second, so it ends within a second of its run without beating again: heartbeats, and the
crash detection built on them, are unchanged.

What it leaves: a Prefect whose heartbeat context is not `_send_heartbeats(engine, join_on_exit=...)` is left as
it is (`install()` returns False; runs then take the extra second per flow, nothing breaks).

Key trade-off: wrapping a private Prefect function (checked by name and signature, so a Prefect that changes it
turns this off instead of failing) for a second per stage of every run a user watches in the UI.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

MARK = "unjoined_by_draftflow"


def install() -> bool:
    """Leave subflows' heartbeat threads unjoined in this process; True if that is (now or before) in effect."""
    from prefect import flow_engine

    current = getattr(flow_engine, "_send_heartbeats", None)
    if current is None:
        return False
    if getattr(current, MARK, False):
        return True
    try:
        takes_join = "join_on_exit" in inspect.signature(current).parameters
    except (TypeError, ValueError):
        return False
    if not takes_join:
        return False

    @functools.wraps(current)
    def heartbeats(engine: Any, join_on_exit: bool = True) -> Any:
        return current(engine, join_on_exit=join_on_exit and not is_subflow(engine))

    setattr(heartbeats, MARK, True)
    flow_engine._send_heartbeats = heartbeats
    return True


def is_subflow(engine: Any) -> bool:
    """Whether the engine runs a flow called from another flow (its run has a parent task run)."""
    return getattr(getattr(engine, "flow_run", None), "parent_task_run_id", None) is not None
