"""A refresh SIGKILLed mid-train: a second refresh meanwhile stops in one line and leaves the watermark alone; the
killed one's batch stays in the watermark as unfinished, the re-run resumes it (training from its checkpoint)
and finishes it with one history line; a refresh after that has no new traffic and does nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.reliability.procs import TINY, code_dir, temporary_server_env
from tests.traffic_logs import requests, write_log

pytestmark = pytest.mark.reliability


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return temporary_server_env(tmp_path_factory)


def _refresh(root, logs, *sets: str, held_at: Path | None = None) -> list[str]:
    """The refresh command; with `held_at` (a marker file), the run freezes at its 2nd training checkpoint (a kill
    point: an event, not a time, decides when the test acts) and writes the marker."""
    args = [f"root={root}", f"refresh.traffic={logs}", "lock.ttl_s=5", *TINY, "train.max_steps=200", *sets]
    cli = ["refresh", "configs/tiny.yaml", *[f"--set={s}" for s in args]]
    if held_at is None:
        return [sys.executable, "-m", "flows.cli", *cli]
    return [sys.executable, "-m", "tests.reliability.killable", "file:train/*/work/checkpoints/step_*:2",
            str(held_at), "--", *cli]


def test_a_refresh_killed_mid_train_resumes_its_batch_and_the_watermark_stays_right(env, tmp_path):
    root, logs, log = tmp_path / "run", tmp_path / "logs", tmp_path / "first.log"
    write_log(logs, "day1.jsonl", requests(30, 1), bad=True)
    marker = tmp_path / "held"
    with open(log, "w") as fh:
        proc = subprocess.Popen(_refresh(root, logs, held_at=marker), cwd=code_dir(env), env=env, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
        end = time.monotonic() + 900
        while not marker.exists():  # held mid-train, its lease still renewed by its own thread
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < end, log.read_text()[-3000:]
            time.sleep(0.2)
        watermark = (root / "refresh/watermark.json").read_text()
        # A second refresh while this one holds the root: one line, and the watermark untouched.
        write_log(logs, "day2.jsonl", requests(10, 2))
        second = subprocess.run(_refresh(root, logs), cwd=code_dir(env), env=env, capture_output=True, text=True,
                                timeout=300)
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
        assert second.stderr.strip().count("\n") == 0 and "draftflow: error:" in second.stderr, second.stderr
        assert (root / "refresh/watermark.json").read_text() == watermark
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    (logs / "day2.jsonl").unlink()  # the resumed refresh must take only its own batch's files
    batch = json.loads(watermark)["batches"]
    assert [b["n"] for b in batch] == [1] and not (root / "refresh/history.json").exists()
    again = subprocess.run(_refresh(root, logs, "lock.wait_s=60"), cwd=code_dir(env), env=env, capture_output=True,
                           text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    first_step = next(line for line in again.stdout.splitlines() + again.stderr.splitlines()
                      if line.startswith("progress: train "))
    assert not first_step.startswith("progress: train 1/"), first_step  # resumed from its checkpoint
    lines = [x for x in again.stdout.splitlines() if x.startswith("refresh ")]
    assert len(lines) == 1 and lines[0].startswith("refresh 1: ") and " new_rows 30 " in lines[0], again.stdout
    assert [b["n"] for b in json.loads((root / "refresh/watermark.json").read_text())["batches"]] == [1]
    last = subprocess.run(_refresh(root, logs), cwd=code_dir(env), env=env, capture_output=True, text=True,
                          timeout=300)
    assert last.returncode == 0 and "no new traffic under" in last.stdout, last.stdout[-2000:] + last.stderr[-2000:]
