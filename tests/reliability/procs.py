"""Helpers of the reliability suite: a Prefect server for CLI runs, runs killed at a kill point, run folders.

Each CLI run is its own process group (start_new_session), so SIGKILL takes the run and anything it
started. One `prefect server start` serves a module: a run then skips the ~7 s temporary server.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.reliability.killable import kill_when_frozen

ROOT = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).parent / "prefect")
# tests/conftest.py TINY_OVERRIDES plus in-shard checkpoints every 4 conversations (regenerate) and
# a training checkpoint every 4 steps, so every stage has several commits to be killed after.
TINY = ["curate.shard_rows=16", "regenerate.max_new_tokens=24", "regenerate.checkpoint_every=4",
        "train.max_steps=24", "train.checkpoint_every=4", "evaluate.max_new_tokens=16", "evaluate.num_prompts=2",
        "drafter.num_layers=1"]


SOURCES = ("draftflow", "flows", "tasks", "configs", "tests", "pyproject.toml")


def snapshot_code(dest: Path) -> Path:
    """A copy of the code that runs are started from (their cwd comes first on sys.path, before the
    editable install), so an edit to the working tree during a long test changes no stage fingerprint."""
    dest.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "fixtures")
    for name in SOURCES:
        src = ROOT / name
        (shutil.copytree(src, dest / name, ignore=ignore) if src.is_dir() else shutil.copy2(src, dest / name))
    return dest


def temporary_server_env(tmp_path_factory) -> dict[str, str]:
    """The environment of CLI runs that start Prefect's temporary server (no PREFECT_API_URL), from a snapshot of
    the code, with a PREFECT_HOME of their own."""
    code = snapshot_code(tmp_path_factory.mktemp("code"))
    home = tmp_path_factory.mktemp("prefect-home")
    base = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    return {**base, "PREFECT_HOME": str(home), "CODE_SNAPSHOT": str(code)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def prefect_server(tmp: Path):
    """A `prefect server start` on a free port; yields the env for CLI runs that report to it."""
    proc, client_env = start_prefect_server(tmp)
    try:
        yield client_env
    finally:
        stop_prefect_server(proc)


def start_prefect_server(tmp: Path) -> tuple[subprocess.Popen, dict]:
    """`prefect server start` on a free port, its own process group, once healthy: (process, env for runs)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp / "server-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_UI_ENABLED="false")
    tmp.mkdir(parents=True, exist_ok=True)
    log_path = tmp / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    try:
        wait_healthy(url, proc, log_path)
    except BaseException:
        stop_prefect_server(proc)
        raise
    return proc, {**os.environ, "PREFECT_API_URL": url, "PREFECT_HOME": str(tmp / "client-home")}


def stop_prefect_server(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    try:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=30)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    """Poll `url`/health until the server answers 200; fail the test with its log if it exits or never does."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            pytest.fail(f"the server at {url} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    pytest.fail(f"the server at {url} not healthy after {timeout} s:\n{log.read_text()[-3000:]}")


def code_dir(env: dict) -> Path:
    """Where runs start (`CODE_SNAPSHOT` in env: a `snapshot_code` copy; else the repository)."""
    return Path(env.get("CODE_SNAPSHOT") or ROOT)


def cli_args(root: str, *extra: str) -> list[str]:
    sets = [f"--set={s}" for s in (f"root={root}", *TINY, *extra)]
    return ["run", "configs/tiny.yaml", *sets]


# Prefect's line for a failed task run ("Task run failed with <type>: ... - Retry 1/2 will start ..."), and Python's
# for an uncaught error: a run that a kill or a resume disturbed, and no fault, shows neither. A retried task still
# ends the run well, so only its log tells (a race in a resumed run's first stage was found this way).
FAILURE_MARKS = ("Task run failed with", "Traceback (most recent call last)")


def failures_in(logs: list[Path]) -> list[str]:
    """Each line of `logs` that says a task failed or starts a traceback, as '<log name>: <line>'."""
    return [f"{log.name}: {line}" for log in logs for line in log.read_text(errors="replace").splitlines()
            if any(mark in line for mark in FAILURE_MARKS)]


def run_to_end(env: dict, root: str, log: Path, *extra: str, timeout: float = 300, failures_ok: bool = False) -> None:
    """A whole run (no kill point); fails the test with the log's tail if it does not succeed, or if a task failed
    on the way (`failures_in`) unless the test injects faults that tasks retry (`failures_ok`)."""
    cmd = [sys.executable, "-m", "tests.reliability.killable", "-", "-", "--", *cli_args(root, *extra)]
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, cwd=code_dir(env), env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout,
                            start_new_session=True).returncode
    assert rc == 0, f"run exited {rc}:\n{log.read_text()[-4000:]}"
    assert failures_ok or failures_in([log]) == [], f"a task failed (and was retried):\n{log.read_text()[-4000:]}"


def run_until_line(env: dict, root: str, log: Path, prefix: str, *extra: str, timeout: float = 300) -> str:
    """A run, SIGKILLed (its process group) once its output has a line starting with `prefix`; its output.
    A run that ends first must have succeeded. For a test that needs a re-run's start, not its end."""
    cmd = [sys.executable, "-m", "flows.cli", *cli_args(root, *extra)]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=code_dir(env), env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    end = time.monotonic() + timeout
    try:
        while not any(line.startswith(prefix) for line in _whole_lines(log)):
            if proc.poll() is not None:
                assert proc.returncode == 0, f"run exited {proc.returncode}:\n{log.read_text()[-4000:]}"
                break
            if time.monotonic() > end:
                pytest.fail(f"no line starting {prefix!r} within {timeout} s:\n{log.read_text()[-4000:]}")
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return log.read_text()


def _whole_lines(log: Path) -> list[str]:
    text = log.read_text()
    return text[: text.rfind("\n") + 1].splitlines()  # a line still being written is not read yet


def run_killed_at(env: dict, root: str, point: str, log: Path, *extra: str, timeout: float = 180) -> None:
    """Start a run with `point` armed, wait for its marker (the event happened), SIGKILL its process group."""
    marker = log.with_suffix(".killed")
    marker.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "tests.reliability.killable", point, str(marker), "--", *cli_args(root, *extra)]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=code_dir(env), env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        kill_when_frozen(proc, marker, timeout, group=True,
                         describe=lambda: f" (kill point {point}):\n{log.read_text()[-4000:]}")


def run_with_fault(env: dict, root: str, point: str, action: str, log: Path, timeout: float = 300) -> tuple[int, str]:
    """A run that meets a storage fault (`action`, see killable.py) at `point` and goes on into it; its exit
    code and output. Fails the test if the point is never reached."""
    marker = log.with_suffix(".fault")
    cmd = [sys.executable, "-m", "tests.reliability.killable", point, str(marker), "--", *cli_args(root)]
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, cwd=code_dir(env), env={**env, "KILLABLE_DO": action}, stdout=fh,
                            stderr=subprocess.STDOUT, timeout=timeout, start_new_session=True).returncode
    out = log.read_text()
    assert marker.exists(), f"the fault point {point} was never reached (exit {rc}):\n{out[-4000:]}"
    return rc, out


# pid -> its start time (jiffies since boot), as `descendants` found it. This machine's pid_max is 32,768 and torch
# and vLLM threads draw from the same ids, so within a CI run an id is reused: `alive` counts a pid only while it
# is the process that was found (a vLLM SIGTERM test once saw its engine's pid alive again as another leg's).
_FOUND_STARTED: dict[int, str] = {}


def _stat(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat's fields from the state on (field 3 is [0], the start time, field 22, is [19])."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc), zombies left out."""
    children: dict[int, list[int]] = {}
    started: dict[int, str] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _stat(stat.parent.name)
        if fields is not None and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
            started[int(stat.parent.name)] = fields[19]
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    _FOUND_STARTED.update({p: started[p] for p in found})
    return found


def alive(pids: set[int]) -> set[int]:
    """The pids still running (not zombies) and, for those `descendants` found, still the same process."""
    out = set()
    for pid in pids:
        fields = _stat(pid)
        if fields is not None and fields[0] != "Z" and _FOUND_STARTED.get(pid, fields[19]) == fields[19]:
            out.add(pid)
    return out


def described(pids: set[int]) -> str:
    """Each of `pids` as `pid state (parent ppid): command line`, for a failure message that says what was left; a
    resource tracker with what holds its pipe open (it ends once they have all closed it)."""
    from flows.signals import _cmdline, _pipe_holders, _tracker_fd

    out = []
    for pid in sorted(pids):
        fields = _stat(pid)
        cmd = _cmdline(pid).replace(b"\0", b" ").decode(errors="replace")[:160] or "?"
        if _tracker_fd(pid) is not None:
            cmd += f" [its pipe held by: {described(set(_pipe_holders([pid]))) or 'none'}]"
        out.append(f"{pid} {fields[0] if fields else '?'} (parent {fields[1] if fields else '?'}): {cmd}")
    return "; ".join(out)


LONG_TRAINING = "train.max_steps=200"  # long enough that a fault lands while training


def seeded_before(stage: str, root: Path, finished: Path) -> Path:
    """`root` holding copies of `finished`'s stages before `stage` (a finished run of the same config, its code a
    snapshot of the same tree: the same fingerprints), so that a test about `stage` starts where a user's re-run
    would, those stages reused rather than computed again (~45 s idle of a test about training's first run)."""
    from draftflow.stages.registry import needed

    for before in needed(stage)[:-1]:
        shutil.copytree(finished / before, root / before)
    return root


def start_and_wait_for_training(env, root: Path, log: Path, steps: str = LONG_TRAINING
                                ) -> tuple[subprocess.Popen, set[int]]:
    """Start a run of `steps` training steps; return it (and what it has started) once its 2nd training
    checkpoint is on disk (an event, not a sleep, decides when the test acts)."""
    return start_and_wait_for(env, root, log, lambda: len(list(root.glob("train/*/work/checkpoints/step_*"))) >= 2,
                              "training checkpointed twice", steps)


def start_and_wait_for(env, root: Path, log: Path, ready, what: str, *sets: str) -> tuple[subprocess.Popen, set[int]]:
    """Start a run (`sets`: its --set overrides); return it (and what it has started) once `ready()` (an event on
    disk, not a sleep, decides when the test acts)."""
    cmd = [sys.executable, "-m", "flows.cli", *cli_args(str(root), *sets)]
    fh = open(log, "w")  # noqa: SIM115 - closed by the caller's wait
    proc = subprocess.Popen(cmd, cwd=code_dir(env), env=env, stdout=fh, stderr=subprocess.STDOUT,
                            start_new_session=True)
    proc.log_handle = fh
    end = time.monotonic() + 900
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"the run ended before {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > end:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"not {what} in 900 s:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return proc, descendants(proc.pid)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, float]:
    start = time.monotonic()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"the run did not exit within {timeout} s of the signal")
    proc.log_handle.close()
    return rc, time.monotonic() - start


# The evaluate stage's reports hold this machine's measured step times (the predicted speedup: a
# measurement, like a log line), so two runs of the same code differ there and nowhere else. The
# comparisons leave out exactly those: `speedup` and `phase_seconds` (the stage's wall time per phase) in
# report.json, `speedup` in the manifest's headline, report.md
# (rendered from report.json), and the two reports' sizes and checksums in the manifest.
MEASURED_REPORTS = ("report.json", "report.md")


def without_measurements(rel: Path, data: bytes) -> bytes:
    if rel.parts[0] != "evaluate":
        return data
    if rel.name == "manifest.json":
        m = json.loads(data)
        (m.get("extra", {}).get("evaluation") or {}).pop("speedup", None)
        for s in m["shards"]:
            if s["name"] in MEASURED_REPORTS:
                s.pop("sha256"), s.pop("bytes")
        return json.dumps(m, sort_keys=True).encode()
    if rel.name == "report.json":
        report = json.loads(data)
        for measured in ("speedup", "phase_seconds"):
            report.pop(measured, None)
        return json.dumps(report, sort_keys=True).encode()
    return b"" if rel.name == "report.md" else data


def manifests(root: Path) -> dict[str, bytes]:
    """stage -> manifest.json bytes of every stage folder under `root` (evaluate's without its measured
    step times, see MEASURED_REPORTS)."""
    return {str(p.relative_to(root).parent): without_measurements(p.relative_to(root), p.read_bytes())
            for p in sorted(root.glob("*/*/manifest.json"))}


def assert_equals_uninterrupted(root: Path, want_manifests: dict[str, bytes], want_files: dict[str, str]) -> None:
    """`root` holds what an uninterrupted run wrote (`uninterrupted` in conftest.py), manifest by manifest, file
    by file, and nothing a finished run should not."""
    got = manifests(root)
    assert sorted(got) == sorted(want_manifests)
    for stage, data in got.items():
        assert data == want_manifests[stage], f"{stage}/manifest.json differs from an uninterrupted run's"
    assert sha256_tree(root) == want_files
    assert leftovers(root) == []


def leftovers(root: Path) -> list[str]:
    """What a completed run should not hold: work/ or partial/ folders, temp files, empty folders."""
    bad = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if rel.parts[0] == "_prefect_results":
            continue
        if p.is_dir() and (p.name in ("work", "partial", "parts") or not any(p.iterdir())):
            bad.append(f"{rel}/")
        elif p.is_file() and (p.name.endswith((".tmp", ".part")) or p.name.startswith(".")):
            bad.append(str(rel))
    return bad


def sha256_tree(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file in a stage folder (not Prefect's results, not run.json;
    evaluate's reports without their measured step times, see MEASURED_REPORTS)."""
    return {str(p.relative_to(root)): hashlib.sha256(without_measurements(p.relative_to(root), p.read_bytes()))
            .hexdigest()
            for p in sorted(root.glob("*/*/**/*")) if p.is_file() and not p.relative_to(root).parts[0].startswith("_")}
