"""One run at a time on a run root: a lease object at `<root>/.draftflow-lock.json`.

A run takes the lease before it works on the root, renews it from a heartbeat thread, and drops it
when it ends. A second run finds it held and waits (`lock.wait_s`) or stops in one line naming the
holder. A lease is stale, and taken over, when it has not been renewed for `lock.ttl_s` seconds, or at
once when its holder ran on this host and that process is gone (a killed run).

Taking the lease is an exclusive create: `O_EXCL` on a local root, a conditional PUT
(`If-None-Match: *`, which S3 and S3-compatible stores honour) on s3://. Taking over a stale lease
deletes it and creates anew, so two runs racing for one stale lease still end with one holder
(the loser's exclusive create fails); each renewal re-reads the lease first, and a holder that finds
someone else's token there logs that it lost it rather than writing over it.

Does not know: stages or Prefect. The lease file is in no manifest and no fingerprint.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from draftflow.errors import DraftflowError
from draftflow.store import Store

log = logging.getLogger(__name__)
LOCK_NAME = ".draftflow-lock.json"


class RootBusy(DraftflowError):
    """Another run holds the run root."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def is_stale(lease: dict[str, Any], now: float) -> bool:
    """Not renewed for its ttl, or held by a process of this host that is gone."""
    if now - float(lease.get("renewed", 0)) > float(lease.get("ttl_s", 0)):
        return True
    return lease.get("host") == socket.gethostname() and not _pid_alive(int(lease.get("pid", -1)))


def describe(lease: dict[str, Any], now: float) -> str:
    return (f"run {lease.get('run')!r} (pid {lease.get('pid')} on {lease.get('host')}, renewed "
            f"{max(0.0, now - float(lease.get('renewed', 0))):.0f} s ago)")


def live_holder(store: Store) -> dict[str, Any] | None:
    """The lease of the run working on the root now (one renewed within its ttl, its process alive where it is of
    this host), or None: no run holds it, or its holder is gone (for `status`: a stage "running")."""
    try:
        with store.fs.open(store.path(LOCK_NAME), "rb") as fh:
            lease = json.loads(fh.read() or b"{}")
    except (FileNotFoundError, ValueError):
        return None
    return None if not lease or is_stale(lease, time.time()) else lease


class RunLease:
    """The lease of one run on one root (see the module docstring)."""

    def __init__(self, store: Store, run: str, ttl_s: float):
        self.store, self.run, self.ttl_s = store, run, ttl_s
        self.path = store.path(LOCK_NAME)
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> bytes:
        return json.dumps({"run": self.run, "host": socket.gethostname(), "pid": os.getpid(), "token": self.token,
                           "ttl_s": self.ttl_s, "renewed": time.time()}).encode()

    def _read(self) -> dict[str, Any] | None:
        try:
            with self.store.fs.open(self.path, "rb") as fh:
                return json.loads(fh.read() or b"{}")
        except FileNotFoundError:
            return None
        except ValueError:  # torn: treat as stale
            return {}

    def _create(self) -> bool:
        """Exclusive create of the lease; False when one exists."""
        data = self._record()
        if self.store.is_local:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            return True
        try:
            self.store.fs.pipe_file(self.path, data, mode="create")
        except (FileExistsError, OSError) as exc:
            if isinstance(exc, FileExistsError) or "Precondition" in str(exc) or "412" in str(exc):
                return False
            raise
        return True

    def try_take(self) -> dict[str, Any] | None:
        """Take the lease; None when taken, else the holder's lease."""
        if self._create():
            return None
        held = self._read()
        if held is None:  # released between the two calls: try again
            return self.try_take()
        if is_stale(held, time.time()):
            log.warning("taking over the stale lease of %s on %s", describe(held, time.time()), self.store.base)
            self.store.fs.rm(self.path)
            return None if self._create() else (self._read() or held)
        return held

    def acquire(self, wait_s: float, poll_s: float = 1.0) -> None:
        """Take the lease, waiting up to `wait_s` for a live holder.

        Raises:
            RootBusy: still held after `wait_s` (one line naming the holder).
        """
        deadline = time.monotonic() + wait_s
        while (held := self.try_take()) is not None:
            if time.monotonic() >= deadline:
                raise RootBusy(f"run root {self.store.base} is in use by {describe(held, time.time())}; wait for "
                               "it or stop it (set lock.wait_s to wait); a lease not renewed for "
                               f"{float(held.get('ttl_s', self.ttl_s)):g} s is taken over")
            time.sleep(poll_s)
        self._thread = threading.Thread(target=self._heartbeat, daemon=True, name="draftflow-lease")
        self._thread.start()

    def _heartbeat(self) -> None:
        failing = False
        while not self._stop.wait(self.ttl_s / 3):
            try:
                held = self._read()
                if held is not None and held.get("token") != self.token:
                    log.error("the lease on %s was taken by %s; this run no longer holds the root",
                              self.store.base, describe(held, time.time()))
                    return
                self.store.fs.pipe_file(self.path, self._record())
                failing = False
            except Exception as exc:  # noqa: BLE001 - storage down: the stages meet it too and say so
                if not failing:
                    log.warning("could not renew the lease on %s (%s); still trying", self.store.base,
                                " ".join(f"{type(exc).__name__}: {exc}".split()))
                failing = True

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            held = self._read()
            if held is not None and held.get("token") == self.token:
                self.store.fs.rm(self.path)
        except Exception as exc:  # noqa: BLE001 - storage down: never hide the error the run is ending with
            log.warning("could not release the lease on %s (%s); it expires after %g s", self.store.base,
                        " ".join(f"{type(exc).__name__}: {exc}".split()), self.ttl_s)


_HELD: dict[str, RunLease] = {}  # roots this process holds: nested `holding` blocks share the lease


def release_all() -> None:
    """Release every lease this process holds (for a process about to exit without unwinding its blocks)."""
    for lease in list(_HELD.values()):
        lease.release()


@contextmanager
def holding(root: str, run: str, wait_s: float = 0.0, ttl_s: float = 60.0) -> Iterator[RunLease]:
    """Hold the lease on `root` for the block (see `RunLease.acquire`); re-entrant within a process, so
    the CLI can take it before Prefect starts and the pipeline flow inside it holds the same lease."""
    store = Store(root)
    if store.base in _HELD:
        yield _HELD[store.base]
        return
    lease = RunLease(store, run, ttl_s)
    lease.acquire(wait_s)
    _HELD[store.base] = lease
    try:
        yield lease
    finally:
        del _HELD[store.base]
        lease.release()
