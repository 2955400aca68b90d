"""Prefect's temporary API server for a `draftflow run` without a Prefect server, started early.

Without `PREFECT_API_URL`, Prefect starts a temporary server on the run's first API call (prefect 3.9's
`SubprocessASGIServer`): uvicorn serving `prefect.server.api.server:create_app` on 127.0.0.1 with the UI
and the background services off, the runs kept in `$PREFECT_HOME`'s database, so a later `draftflow
server` shows them. This module starts the same server, with the same command and environment, but
early: the CLI launches it as soon as the run holds its root, so its start-up (~2.6 s of CPU on the
2-core development machine) overlaps the CLI's own imports on the other core, and the CLI process
never imports Prefect's server package (~1.9 s of CPU) only to launch a child. While the run lasts the
server's URL is this process's `PREFECT_API_URL` (the processes it starts inherit it); then the server
is stopped, as Prefect stops its own.

Flow-run heartbeats are off while it serves: they let a server tell a crashed run from a live one, a
temporary server lives and dies with this process, and each flow run's end waits up to 1 s for its
heartbeat thread to wake (a run is 7 flow runs: 3-7 s of the cached re-run's wall time).

Trade-off: it repeats Prefect's private launch recipe (the `PREFECT__SERVER_*` flags below); a Prefect
upgrade that changes it must be mirrored here (tests/test_tempserver.py runs a flow through it).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from draftflow.errors import DraftflowError

# What Prefect's own temporary server gets besides the caller's settings: no UI, no background services.
SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
PORT_TAKEN = 3  # the exit code Prefect relaunches on (another process took the port): done the same here
# uvicorn also exits with 3 when the app fails to start (e.g. its database cannot be opened): a few relaunches
# cover a port race, more would repeat the same failure until the start-up timeout
RELAUNCHES = 3


class TemporaryServer:
    """One temporary Prefect API server in a child process, on a free port of 127.0.0.1."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.port, self.process = _launch(env)
        atexit.register(self.stop)  # a CLI that fails before `serving` stops it at exit, as Prefect does its own

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def wait_ready(self, timeout: float) -> str:
        """Poll `/health` until the server answers; return its API URL.

        Raises:
            DraftflowError: it exited, or did not answer within `timeout` seconds (then it is stopped).
        """
        import httpx

        deadline, relaunched = time.monotonic() + timeout, 0
        with httpx.Client(timeout=5) as client:
            while time.monotonic() < deadline:
                code = self.process.poll()
                if code == PORT_TAKEN and relaunched < RELAUNCHES:
                    self.port, self.process = _launch(self.env)
                    relaunched += 1
                elif code is not None:
                    raise DraftflowError(
                        f"Prefect's temporary server exited with code {code} before it answered; {_REMEDY}"
                    )
                try:
                    if client.get(f"{self.api_url}/health").status_code == 200:
                        return self.api_url
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
        self.stop()
        raise DraftflowError(
            f"Prefect's temporary server did not answer within {timeout:g} s "
            f"(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS); raise it, or {_REMEDY}"
        )

    def stop(self) -> None:
        """Terminate the server (killed if it has not exited 5 s later); safe to call twice."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        atexit.unregister(self.stop)


_REMEDY = "start a server with `draftflow server` and set PREFECT_API_URL to it"


def _launch(env: dict[str, str]) -> tuple[int, subprocess.Popen]:
    """Start uvicorn on a free port with Prefect's server app, as `SubprocessASGIServer` does."""
    import prefect

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "uvicorn",
        "--app-dir",
        str(prefect.__module_path__.parent),
        "--factory",
        "prefect.server.api.server:create_app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "error",
        "--lifespan",
        "on",
    ]
    # Its own session: a terminal's Ctrl-C reaches the run, which stops the server when it has finished
    # with it (not before, as when both shared the terminal's process group). Linux: it also dies with
    # the run if the run is SIGKILLed or OOM-killed (PR_SET_PDEATHSIG), so no server outlives its run.
    return port, subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=die_with_parent)


def check_home(home) -> None:
    """The temporary server keeps its database in `PREFECT_HOME`: one that cannot be written is one line now, not a
    server that fails to start (uvicorn exits, Prefect relaunches it) until the start-up timeout.

    Raises:
        DraftflowError: the folder cannot be made or written.
    """
    import tempfile
    from pathlib import Path

    folder = Path(home).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".draftflow-write-check-"):
            pass
    except OSError as exc:
        raise DraftflowError(
            f"PREFECT_HOME={folder} cannot be written ({type(exc).__name__}: {exc.strerror or exc}); Prefect keeps "
            f"its runs' database there: set PREFECT_HOME to a writable folder, or {_REMEDY}"
        ) from None


def die_with_parent() -> None:
    """In a child before exec: ask Linux to SIGTERM it when its parent dies (a no-op elsewhere)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def start() -> TemporaryServer | None:
    """Launch the temporary server now if this process has no Prefect API, else None (Prefect uses
    `PREFECT_API_URL`; with the temporary server disallowed, Prefect's own error stands)."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url or not settings.server.ephemeral.enabled:
        return None
    check_home(settings.home)
    server = TemporaryServer({**os.environ, **SERVER_ENV, **settings.to_environment_variables(exclude_unset=True)})
    logging.getLogger("prefect.server").info("Starting temporary server on %s", server.api_url.removesuffix("/api"))
    return server


@contextmanager
def serving(server: TemporaryServer | None) -> Iterator[str | None]:
    """Wait for `server`, then point Prefect at it (heartbeats off) until the block ends; stop it then.

    Yields the API URL in use (None with no server: nothing changes). `PREFECT_API_URL` is set in the
    environment and Prefect's global settings are re-read, so threads that do not inherit the caller's
    settings context (Prefect's log and event workers) use this server rather than starting another one.
    """
    if server is None:
        yield None
        return
    from prefect.context import refresh_global_settings_context
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        PREFECT_UI_URL,
        get_current_settings,
        temporary_settings,
    )

    before = os.environ.get("PREFECT_API_URL")
    try:
        url = server.wait_ready(get_current_settings().server.ephemeral.startup_timeout_seconds)
        os.environ["PREFECT_API_URL"] = url
        refresh_global_settings_context()
        # No "View at <url>" lines, as with Prefect's own temporary server: it has no UI and ends with the run.
        off = {PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None, PREFECT_UI_URL: ""}
        with temporary_settings({PREFECT_API_URL: url, **off}):  # also over a caller's own settings context
            yield url
    finally:
        _drain_workers()  # as at Prefect's exit: queued logs and events reach the server before it stops
        server.stop()
        if before is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = before
        refresh_global_settings_context()


def _drain_workers() -> None:
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=5)
