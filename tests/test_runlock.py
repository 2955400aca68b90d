"""One run at a time on a run root: the lease is exclusive locally and on S3, a second run waits or stops
in one line naming the holder, and a killed run's stale lease is taken over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from draftflow.runlock import LOCK_NAME, RootBusy, RunLease, holding
from draftflow.store import Store
from tests.conftest import ROOT, moto_s3


def test_a_held_root_stops_a_second_run_in_one_line_naming_the_holder(tmp_path):
    with holding(str(tmp_path / "root"), "first"):
        with pytest.raises(RootBusy, match=rf"in use by run 'first' \(pid {os.getpid()} on") as err:
            RunLease(Store(str(tmp_path / "root")), "second", ttl_s=60).acquire(wait_s=0)
        assert "\n" not in str(err.value)
    assert not (tmp_path / "root" / LOCK_NAME).exists()  # released at the end of the block


def test_holding_is_reentrant_within_a_process(tmp_path):
    with holding(str(tmp_path), "cli") as outer, holding(str(tmp_path), "flow") as inner:
        assert inner is outer


def test_a_second_run_that_waits_gets_the_root_when_the_first_ends(tmp_path):
    first = RunLease(Store(str(tmp_path)), "first", ttl_s=60)
    first.acquire(wait_s=0)
    second = RunLease(Store(str(tmp_path)), "second", ttl_s=60)
    waiting = threading.Thread(target=second.acquire, kwargs={"wait_s": 120, "poll_s": 0.05})
    waiting.start()
    first.release()
    waiting.join(timeout=120)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["run"] == "second"
    second.release()


def _write_lease(path, **fields):
    lease = {"run": "killed", "host": socket.gethostname(), "pid": os.getpid(), "token": "t", "ttl_s": 60,
             "renewed": time.time()} | fields
    path.write_text(json.dumps(lease))


def test_the_lease_of_a_killed_run_on_this_host_is_taken_over_at_once(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _write_lease(tmp_path / LOCK_NAME, pid=dead.pid)
    with holding(str(tmp_path), "next") as lease:
        assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == lease.token


def test_a_lease_not_renewed_for_its_ttl_is_taken_over(tmp_path):
    _write_lease(tmp_path / LOCK_NAME, host="elsewhere", pid=1, renewed=time.time() - 600)
    with holding(str(tmp_path), "next"):
        pass
    _write_lease(tmp_path / LOCK_NAME, host="elsewhere", pid=1)  # renewed just now, on another host: live
    with pytest.raises(RootBusy, match="in use by run 'killed' .* on elsewhere"):
        with holding(str(tmp_path), "next"):
            pass


def test_the_lease_is_exclusive_on_s3():
    with moto_s3():
        import s3fs

        s3fs.S3FileSystem().mkdir("locks")
        with holding("s3://locks/run", "first") as lease:
            store = Store("s3://locks/run")
            assert json.loads(store.fs.cat(store.path(LOCK_NAME)))["token"] == lease.token
            with pytest.raises(RootBusy, match="in use by run 'first'"):
                RunLease(store, "second", ttl_s=60).acquire(wait_s=0)
        assert not Store("s3://locks/run").exists(Store("s3://locks/run").path(LOCK_NAME))


def test_draftflow_run_on_a_busy_root_exits_2_in_one_line_before_any_work(tmp_path):
    root = tmp_path / "run"
    with holding(str(root), "the-other-run"):
        proc = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(ROOT / "configs" / "tiny.yaml"),
                               "--set", f"root={root}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("draftflow: error:")]
    assert len(errors) == 1 and "in use by run 'the-other-run'" in errors[0]
    assert "Traceback" not in proc.stderr
    assert not any(p.is_dir() for p in root.iterdir())  # no stage was started


def test_status_shows_the_stage_a_live_run_works_on_as_running_and_a_dead_holder_as_nothing(tmp_path, tiny_target):
    from draftflow.runs.runinfo import stage_status
    from draftflow.target import TargetRef
    from tests.conftest import tiny_config

    cfg = tiny_config(tmp_path / "root")
    target = TargetRef(tiny_target.path, tiny_target.fingerprint)
    assert [s["state"] for s in stage_status(cfg, target)][:2] == ["to run", "waits"]
    with holding(cfg.root, "nightly"):
        first, second = stage_status(cfg, target)[:2]
        assert first["state"] == "running" and first["run"].startswith(f"run 'nightly' (pid {os.getpid()} on ")
        assert second["state"] == "waits" and "run" not in second
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _write_lease(tmp_path / "root" / LOCK_NAME, pid=dead.pid)  # a killed run's lease: nobody runs
    assert stage_status(cfg, target)[0]["state"] == "to run"
