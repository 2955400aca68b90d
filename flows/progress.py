"""Stage progress in the Prefect UI: a progress artifact per stage run, and a throughput table at its end.

Listens to `draftflow.progress` (the library's reports). The artifact is created by the first report
of a stage (in the flow or task run that made it) and updated at most every `INTERVAL` seconds, its
description carrying rows/s and the ETA; when the stage's units are all done a one-row table
(`<run>-<stage>-throughput`: units, seconds, units/s) is published. Outside a Prefect run nothing is sent.
"""

from __future__ import annotations

import threading
from uuid import UUID

from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.context import FlowRunContext, TaskRunContext

from draftflow import progress
from draftflow.progress import Progress
from flows.keys import artifact_key

INTERVAL = 2.0  # seconds between updates of one stage's artifact: a few API calls a minute per stage
_lock = threading.Lock()
_artifacts: dict[tuple[str, int], UUID] = {}
_run = {"name": "draftflow"}


def install(run_name: str) -> None:
    """Send progress of this process's stages to Prefect, keyed by `run_name` (idempotent)."""
    _run["name"] = run_name
    progress.add_sink("prefect", _to_prefect, interval=INTERVAL)


def track(run_name: str, stage: str, total: int, unit: str = "rows") -> None:
    """A stage of `total` units begins in the current flow run (its progress artifact is created here)."""
    install(run_name)
    progress.begin(stage, total, unit)


def _percent(p: Progress) -> float:
    return min(100.0, 100.0 * p.done / p.total) if p.total else 0.0


def _to_prefect(p: Progress) -> None:
    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return  # the library ran outside Prefect (a notebook, a unit test)
    key = (p.stage, p.session)
    with _lock:
        artifact = _artifacts.get(key)
        if artifact is None:
            _artifacts[key] = create_progress_artifact(
                _percent(p), key=artifact_key(_run["name"], p.stage, "progress"), description=p.line())
    if artifact is not None:
        update_progress_artifact(artifact, _percent(p), description=p.line())
    if p.finished:
        rate = None if p.rate is None else round(p.rate, 3)
        create_table_artifact(
            table=[{"stage": p.stage, p.unit: p.done, "seconds": round(p.elapsed, 1), f"{p.unit}/s": rate}],
            key=artifact_key(_run["name"], p.stage, "throughput"),
            description=f"{p.stage}: {p.unit} processed in this run and their rate")
