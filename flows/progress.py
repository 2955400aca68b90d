"""Stage progress in the Prefect UI: a progress artifact per stage run, and a throughput table at its end.

Listens to `draftflow.progress` (the library's reports). The artifact is created by the first report
of a stage (in the flow or task run that made it) and updated at most every `INTERVAL` seconds, its
description carrying rows/s and the ETA; when the stage's units are all done a one-row table
(`<run>-<stage>-throughput`: units, seconds, units/s) is published. Outside a Prefect run nothing is sent.

The API calls are made by one background thread, never by the stage's own: a report only queues its
snapshot (the newest per stage replaces an unsent one), so a slow or lost API (Prefect's client retries
for minutes) never holds up a training step or a shard. `flush` waits (bounded) for the queue to drain:
the pipeline calls it before it returns, so the UI shows each stage's last figures.
"""

from __future__ import annotations

import atexit
import contextvars
import logging
import threading
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.context import FlowRunContext, TaskRunContext

from draftflow import progress
from draftflow.progress import Progress
from flows.keys import artifact_key

INTERVAL = 2.0  # seconds between updates of one stage's artifact: a few API calls a minute per stage
FLUSH_S = 10.0  # how long `flush` waits for queued updates to reach the API
log = logging.getLogger(__name__)
_lock = threading.Lock()
_artifacts: dict[tuple[str, int], UUID] = {}
_run = {"name": "draftflow"}
_queue: dict[tuple, tuple[contextvars.Context, Any]] = {}  # newest unsent snapshot (or document) per stage
_changed = threading.Condition()
_sending = [0]  # snapshots taken off the queue and not yet sent
_sender: list[threading.Thread] = []


def install(run_name: str) -> None:
    """Send progress of this process's stages to Prefect, keyed by `run_name` (idempotent)."""
    _run["name"] = run_name
    progress.add_sink("prefect", _to_prefect, interval=INTERVAL)
    progress.add_document_sink("prefect", _document_to_prefect)


def track(run_name: str, stage: str, total: int, unit: str = "rows") -> None:
    """A stage of `total` units begins in the current flow run (its progress artifact is created here)."""
    install(run_name)
    progress.begin(stage, total, unit)


def _percent(p: Progress) -> float:
    return min(100.0, 100.0 * p.done / p.total) if p.total else 0.0


@dataclass(frozen=True)
class _Document:
    """A stage's live markdown document (`progress.document`): a markdown artifact, a new version each time."""

    stage: str
    key: str
    markdown: str


def _document_to_prefect(stage: str, key: str, markdown: str) -> None:
    _enqueue(("document", stage, key), _Document(stage, key, markdown))


def _to_prefect(p: Progress) -> None:
    _enqueue((p.stage, p.session), p)


def _enqueue(key: tuple, item: Progress | _Document) -> None:
    """Queue `item` for the sender thread, with the caller's context (the Prefect run the artifact belongs to)."""
    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return  # the library ran outside Prefect (a notebook, a unit test)
    with _changed:
        _queue[key] = (contextvars.copy_context(), item)
        if not _sender:
            _sender.append(threading.Thread(target=_send_forever, name="draftflow-progress-ui", daemon=True))
            _sender[0].start()
        _changed.notify_all()


def _send_forever() -> None:
    failing = False
    while True:
        with _changed:
            _changed.wait_for(lambda: _queue)
            key = next(iter(_queue))
            ctx, p = _queue.pop(key)
            _sending[0] += 1
        try:
            ctx.run(_send, p)
            failing = False
        except Exception as exc:  # noqa: BLE001 - the UI's figures are best effort; the stage goes on
            if not failing:
                log.warning("progress to the Prefect UI failed (%s: %s); still trying", type(exc).__name__, exc)
            failing = True
        finally:
            with _changed:
                _sending[0] -= 1
                _changed.notify_all()


def flush(timeout: float = FLUSH_S) -> bool:
    """Wait up to `timeout` seconds for queued updates to be sent; whether they all were."""
    with _changed:
        return _changed.wait_for(lambda: not _queue and not _sending[0], timeout)


atexit.register(flush, 2.0)  # a stage flow run on its own (a deployment) sends its last figures too


def _send(p: Progress | _Document) -> None:
    if isinstance(p, _Document):
        create_markdown_artifact(p.markdown, key=artifact_key(_run["name"], p.stage, p.key),
                                 description=f"{p.stage}: {p.key} (updated while the stage runs)")
        return
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
