"""What `draftflow run` shows on the terminal: progress bars (or plain progress lines), and Prefect's log
with the tracebacks of user errors left out (the UI keeps them).

What it does not know: stages or stores.
"""

from __future__ import annotations

import logging
import sys
import threading
from contextlib import contextmanager

from draftflow.errors import DraftflowError

SIGNAL_CRASH = "was aborted by a"  # Prefect's crash message for a SIGTERM or SIGINT ("... termination signal.")


class _UserErrorsWithoutTraceback(logging.Filter):
    """On the console, a DraftflowError (bad input the user must fix) or a storage error of a known cause
    (a full or read-only device, refused permissions or credentials, an endpoint lost) is its one-line message.

    Prefect logs every failed task and flow with its traceback; for user errors that
    buries the message under library frames. The UI's log handler keeps the traceback.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, KeyboardInterrupt) or SIGNAL_CRASH in record.getMessage():
            return False  # a run stopped by a signal ends in one line of its own (`flows.signals.end_interrupted`)
        if isinstance(exc, DraftflowError) or _user_storage_error(exc):
            record.exc_info, record.exc_text = None, None
        return True


STORAGE_LIBRARIES = ("botocore", "aiobotocore", "s3fs", "fsspec")  # their exceptions are storage's answers
STORAGE_CLIENTS = (*STORAGE_LIBRARIES, "aiohttp")  # and, in log records, the HTTP client under them


def _user_storage_error(exc: BaseException | None) -> bool:
    """A storage error of a known cause (a full device, an endpoint lost), or any error of the S3 client's
    libraries (aiohttp's reset uploads, logged by asyncio): its message says it all."""
    if exc is None:
        return False
    from draftflow.store import storage_cause

    return storage_cause(exc) is not None or type(exc).__module__.split(".")[0] in STORAGE_CLIENTS


def quiet_user_errors() -> None:
    # Prefect's console handler sits on the root logger; its API handler (the UI) is left alone.
    for handler in logging.getLogger().handlers + logging.getLogger("prefect").handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            handler.addFilter(_UserErrorsWithoutTraceback())



@contextmanager
def terminal_progress():
    """Progress of long stages on stderr while the block runs: rich bars on a terminal, else a plain
    line per stage every PLAIN_EVERY seconds (and when it ends)."""
    from draftflow import progress

    bars = _RichBars() if sys.stderr.isatty() else None
    if bars is None:
        progress.add_sink("terminal", lambda p: print(f"progress: {p.line()}", file=sys.stderr, flush=True),
                          interval=PLAIN_EVERY)
    else:
        progress.add_sink("terminal", bars.update, interval=0.25)
    try:
        yield
    finally:
        progress.remove_sink("terminal")
        if bars is not None:
            bars.stop()


PLAIN_EVERY = 10.0


class _RichBars:
    """One rich bar per stage, drawn on the console Prefect logs to (so log lines print above the bars)."""

    def __init__(self):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn

        console = next((h.console for h in logging.getLogger().handlers if hasattr(h, "console")), None)
        # Explicit styles: Prefect's console has its own theme, without rich's `bar.*` styles.
        bar = BarColumn(style="grey37", complete_style="cyan", finished_style="green", pulse_style="cyan")
        self.bars = Progress(TextColumn("{task.description:<11}"), bar,
                             TextColumn("{task.completed}/{task.total} {task.fields[unit]}  {task.fields[speed]}"),
                             console=console or Console(stderr=True), transient=False)
        self.tasks: dict[tuple[str, int], int] = {}
        self.started = False
        self._lock = threading.Lock()  # shard threads report at once; one bar per stage

    def update(self, p) -> None:
        from draftflow.progress import duration

        with self._lock:
            if not self.started:
                self.bars.start()
                self.started = True
            key = (p.stage, p.session)
            if key not in self.tasks:
                self.tasks[key] = self.bars.add_task(p.stage, total=p.total or None, unit=p.unit, speed="")
        speed = "" if p.rate is None else f"{p.rate:.3g} {p.unit}/s"
        if p.eta is not None and not p.finished:
            speed += f"  ETA {duration(p.eta)}"
        elif p.finished:
            speed += f"  {duration(p.elapsed)}"
        self.bars.update(self.tasks[key], completed=p.done, total=p.total or None, speed=speed)

    def stop(self) -> None:
        if self.started:
            try:
                self.bars.stop()
            except Exception as exc:  # a drawing problem must not fail a finished run
                print(f"draftflow: progress bars: {exc}", file=sys.stderr)
