"""A device that fills up, or turns read-only, in the middle of a run: a real tmpfs (mounted by the test,
which needs root; skipped elsewhere) holds the run's root, and the fault happens at an exact event
(killable.py's fault points), not after a sleep.

The run must end with one line naming the path and the cause (for a full device, also what the rest of
the run needs by the plan's estimate), with no traceback and no retry; every stage it marked complete
must be an undisturbed run's; once space is freed (or the device writable again) the re-run completes
and equals an undisturbed run byte for byte.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.reliability.procs import leftovers, manifests, run_to_end, run_with_fault, seeded_before, sha256_tree

pytestmark = pytest.mark.reliability

DISK = "96m"  # a tiny run's root is ~11 MiB; preflight wants 64 MiB free

# In order, one root (as test_kill_points.py chains its kills): each run meets its fault, is put right, and
# the next run resumes and meets the next fault. (fault point, fault, words the one line must hold)
FAULTS = [
    ("file:tokenize/*/manifest.json:1", "readonly", ["Read-only file system", "writable"]),
    ("file:extract/*/train-*:1", "fill", ["No space left on device", "the plan estimates", "free now",
                                          "free space there"]),
    ("file:train/*/work/checkpoints/step_*:1", "fill", ["No space left on device", "the plan estimates", "train",
                                                        "free now"]),
]


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-R", "-l", str(mount)], check=False)


def test_storage_faults_mid_run_are_one_line_and_the_rerun_matches(env, uninterrupted, finished_run, small_disk,
                                                                   tmp_path):
    _, (want_manifests, want_files) = uninterrupted
    root, ballast = small_disk / "run", small_disk / "ballast"
    seeded_before("tokenize", root, finished_run)  # the first fault is in tokenize: the run starts there
    for i, (point, fault, words) in enumerate(FAULTS):
        rc, out = run_with_fault(env, str(root), point, f"{fault}:{ballast if fault == 'fill' else root}",
                                 tmp_path / f"fault-{i}.log")
        last = out.strip().splitlines()[-1]
        assert rc == 2 and last.startswith("draftflow: error: "), out[-3000:]
        assert str(root) in last and all(w in last for w in words), last
        assert "Traceback" not in out and "Retrying" not in out and "retry" not in out.lower(), out[-3000:]
        done = manifests(root)
        assert all(want_manifests[k] == v for k, v in done.items()), "a stage marked complete differs"
        if fault == "fill":  # put right: space freed, or the folder writable again
            ballast.unlink()
        else:
            subprocess.run(["umount", str(root)], check=True)  # the read-only bind mount over it
    run_to_end(env, str(root), tmp_path / "rerun.log")
    assert manifests(root) == want_manifests and sha256_tree(root) == want_files
    assert leftovers(root) == []
