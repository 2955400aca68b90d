"""The Prefect API a run reports to: refused in one line when it does not answer at start, watched while
the run lasts, and the run stopped in one line when it is lost.

Prefect's client retries a call to a dead API for minutes and then fails with tracebacks; a run cannot
finish its stages without the API either (each task's state goes through it). So `watching` polls the
API's `/health` every `POLL_S` from a thread; after `LOST_AFTER_S` without an answer it sends this
process SIGTERM with the API as the stop's reason (`draftflow.interrupt.request`), so training checkpoints
the step it is at, and then ends the process itself in one line (`flows.signals.end_now`: the lease is
released, children end): Prefect's own unwinding would wait minutes on the lost API. Everything
committed stays in the store, and a re-run with the API back resumes there.

What it does not know: stages, stores, or which server it is (the CLI's temporary one or the user's).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from draftflow.errors import DraftflowError
from flows.signals import stop_run

CHECK_S = 10.0  # at start: how long a run waits for PREFECT_API_URL to answer
LOST_AFTER_S = 30.0  # mid-run: no answer for this long and the run stops (env DRAFTFLOW_API_LOST_AFTER_S)
POLL_S = 2.0


def check_reachable(url: str, timeout: float = CHECK_S) -> None:
    """Raise DraftflowError (one line) unless `url`'s `/health` answers 200 within `timeout` seconds."""
    why = _ask(url, timeout)
    if why is not None:
        raise DraftflowError(f"the Prefect API at {url} does not answer ({why}); start it (`draftflow server`) "
                             "or unset PREFECT_API_URL (a run then starts its own temporary server)")


def _ask(url: str, within: float) -> str | None:
    """None once `/health` answers 200 (polled for up to `within` seconds), else what went wrong last."""
    import httpx

    deadline, why = time.monotonic() + within, "no answer"
    with httpx.Client(timeout=min(5.0, within)) as client:
        while True:
            try:
                code = client.get(f"{url.rstrip('/')}/health").status_code
                if code == 200:
                    return None
                why = f"HTTP {code} from /health"
            except httpx.HTTPError as exc:
                why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if time.monotonic() >= deadline:
                return why
            time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))


def lost_after_s() -> float:
    """LOST_AFTER_S, or DRAFTFLOW_API_LOST_AFTER_S (e.g. longer, to ride out a server's restart)."""
    value = os.environ.get("DRAFTFLOW_API_LOST_AFTER_S")
    try:
        return LOST_AFTER_S if value is None else float(value)
    except ValueError:
        raise DraftflowError(f"DRAFTFLOW_API_LOST_AFTER_S={value!r} is not a number of seconds") from None


@contextmanager
def watching(url: str | None, lost_after: float | None = None) -> Iterator[None]:
    """While the block runs, stop this process's run if `url` stops answering for `lost_after` seconds
    (default `lost_after_s()`). No URL: nothing is watched."""
    if url is None:
        yield
        return
    lost_after = lost_after_s() if lost_after is None else lost_after
    done = threading.Event()

    def watch() -> None:
        while not done.wait(POLL_S):
            why = _ask(url, lost_after)
            if why is not None and not done.is_set():
                stop_run(f"the Prefect API at {url} stopped answering for {lost_after:g} s ({why})")
                return

    thread = threading.Thread(target=watch, name="draftflow-api-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
