"""`python -m flows.cli run …` with one kill point armed: the child stops dead at an exact event.

Run as `python -m tests.reliability.killable <kill point> <marker file> -- <draftflow cli args>`.
A kill point is one of

- `file:<glob>:<n>`: right after the n-th file or folder this process commits (os.replace / os.rename,
  as the store, the stages and checkpoints do) whose path relative to the run root matches `<glob>`;
- `call:<module>:<function>:<n>`: at the n-th call of a module-level function (e.g. a training step).

At the kill point the thread that reached it writes the marker file and blocks; the test sees the marker
appear and SIGKILLs the whole process group, so the kill lands at that event and not at whatever the
other threads reach during a sleep. With `KILLABLE_DO` set in its environment the point is a storage
fault instead (`fill:<file>`: the device fills up; `readonly:<mount>`: it turns read-only) and the run
goes on into it. Without a kill point (`-`) this is the plain CLI.
"""

from __future__ import annotations

import fnmatch
import importlib
import os
import sys
import threading
import time
from pathlib import Path


def _freeze(marker: str, limit_s: float = 300) -> None:
    """At the point: block for the test's SIGKILL, or (KILLABLE_DO set) do a storage fault and go on."""
    action = os.environ.get("KILLABLE_DO")
    if action:
        _storage_fault(*action.split(":", 1))
        Path(marker).write_text(action)
        return
    Path(marker).write_text(str(os.getpid()))
    time.sleep(limit_s)  # the test kills the process group now
    os._exit(3)  # never killed (the test itself died): do not linger


def _storage_fault(kind: str, path: str) -> None:
    """`fill:<file>`: write `file` until its device is full. `readonly:<folder>`: a read-only bind mount of
    `folder` over itself (a remount of the device would fail while files are open for writing); the test
    unmounts it to make the folder writable again."""
    import errno
    import subprocess

    if kind == "readonly":
        subprocess.run(["mount", "--bind", path, path], check=True)
        for _ in range(100):  # busy while another thread has just opened a file there for writing
            if subprocess.run(["mount", "-o", "remount,bind,ro", path], capture_output=True).returncode == 0:
                return
            time.sleep(0.05)
        raise RuntimeError(f"could not make {path} read-only")
    assert kind == "fill", kind
    with open(path, "wb", buffering=0) as fh:
        for chunk in (1 << 20, 4096, 1):  # big writes, then the last few pages, then bytes
            try:
                while True:
                    fh.write(b"\0" * chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise


def _arm_file(glob: str, n: int, root: str, marker: str) -> None:
    count, lock = [0], threading.Lock()
    root = os.path.abspath(root)

    def hook(real):
        def commit(src, dst, *args, **kw):
            real(src, dst, *args, **kw)
            rel = os.path.relpath(os.path.abspath(os.fspath(dst)), root)
            if os.environ.get("KILLABLE_LOG"):  # every commit, to choose kill points
                with open(os.environ["KILLABLE_LOG"], "a") as fh:
                    fh.write(rel + "\n")
            if fnmatch.fnmatch(rel, glob):
                with lock:
                    count[0] += 1
                    hit = count[0] == n
                if hit:
                    _freeze(marker)
        return commit

    os.replace, os.rename = hook(os.replace), hook(os.rename)


def arm_call(module: str, name: str, n: int, marker: str) -> None:
    """Freeze this process (see `_freeze`) at the n-th call of `module.name`, before the call runs."""
    mod = importlib.import_module(module)
    real, count, lock = getattr(mod, name), [0], threading.Lock()

    def call(*args, **kw):
        with lock:
            count[0] += 1
            hit = count[0] == n
        if hit:
            _freeze(marker)
        return real(*args, **kw)

    setattr(mod, name, call)


def arm(point: str, root: str, marker: str) -> None:
    """Arm `point` (`file:…` relative to the run root `root`, or `call:…`) in this process."""
    kind, *spec = point.split(":")
    if kind == "file":
        _arm_file(spec[0], int(spec[1]), root, marker)
    else:
        arm_call(spec[0], spec[1], int(spec[2]), marker)


def main(argv: list[str]) -> int:
    point, marker, sep, *cli = argv
    assert sep == "--", "usage: killable <kill point> <marker> -- <cli args>"
    root = next(a.split("root=", 1)[1] for a in reversed(cli) if a.removeprefix("--set=").startswith("root="))
    if point != "-":
        arm(point, root, marker)
    from flows.cli import main as cli_main

    return cli_main(cli)


def kill_when_frozen(proc, marker: Path, timeout: float = 600, group: bool = False,
                     describe=lambda: "") -> None:
    """Wait until `proc` (started with a kill point armed) writes `marker`, then SIGKILL it (its whole process
    group with `group`) and reap it. Fails the test if it exits first or never gets there, with `describe()`
    (e.g. the run's log tail) appended: an event, not a time, decides where the kill lands, so a loaded
    machine moves only when it happens."""
    import signal

    import pytest

    end = time.monotonic() + timeout
    try:
        while not marker.exists():
            if proc.poll() is not None:
                pytest.fail(f"the kill point was never reached: the process exited {proc.returncode}{describe()}")
            if time.monotonic() > end:
                pytest.fail(f"the kill point was not reached in {timeout} s{describe()}")
            time.sleep(0.02)
    finally:
        if group:  # also whatever the run started, even if the run itself has exited
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        elif proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
