"""Remote roots: checkpoints are copied to the store, so a retry on another machine resumes.

A run preempted on machine A (its work folder on A's local disk) is resumed on machine B,
which has an empty work folder and only the store (a real S3 server): B ends with the
weights of an uninterrupted run.
"""

from __future__ import annotations

import pytest
import torch

from draftflow.store import Store
from draftflow.training.checkpoint import latest_checkpoint
from draftflow.training.loop import Hooks, train_drafter
from draftflow.training.mirror import MIRROR_DONE, pull_checkpoint, push_checkpoint
from tests.conftest import preempt_training
from tests.test_train import samples, tcfg, weights  # noqa: F401  (the samples fixture)


def test_a_preempted_run_resumes_on_another_machine_from_the_store(tmp_path, monkeypatch, s3_env, target,
                                                                    samples, dcfg):  # noqa: F811
    store = Store("s3://mirror-bucket/run")
    store.fs.mkdir("mirror-bucket")
    mirror = store.stage_path("train", "fp", "work", "checkpoints")
    push = lambda folder: push_checkpoint(store, mirror, folder)  # noqa: E731

    full = train_drafter(samples, target, dcfg, tcfg(), str(tmp_path / "uninterrupted"))

    restore = preempt_training(monkeypatch, at=8)  # machine A dies during step 8, after the step-5 checkpoint
    with pytest.raises(RuntimeError, match="preempted"):
        train_drafter(samples, target, dcfg, tcfg(), str(tmp_path / "machine-a"), hooks=Hooks(on_checkpoint=push))
    restore()
    remote = sorted(p.rsplit("/", 1)[-1] for p in store.fs.ls(mirror, detail=False))
    assert remote == ["step_00000005"]
    assert store.fs.exists(f"{mirror}/step_00000005/{MIRROR_DONE}")  # the marker, written last

    b = tmp_path / "machine-b"
    got = pull_checkpoint(store, mirror, str(b))
    assert got is not None and latest_checkpoint(b).name == "step_00000005"
    assert pull_checkpoint(store, mirror, str(b)) is None  # not newer than what B has now
    resumed = train_drafter(samples, target, dcfg, tcfg(), str(b), hooks=Hooks(on_checkpoint=push))
    assert resumed == full
    u, r = weights(tmp_path / "uninterrupted"), weights(b)
    assert set(u) == set(r) and all(torch.equal(u[k], r[k]) for k in u)
    # B's later checkpoints were copied too; only the newest two are kept in the store.
    assert sorted(p.rsplit("/", 1)[-1] for p in store.fs.ls(mirror, detail=False)) == \
        ["step_00000010", "step_00000012"]


def test_an_incomplete_remote_checkpoint_is_ignored(tmp_path, s3_env):
    store = Store("s3://mirror-bucket2/run")
    store.fs.mkdir("mirror-bucket2")
    mirror = store.stage_path("train", "fp", "work", "checkpoints")
    store.fs.pipe_file(f"{mirror}/step_00000009/model.safetensors", b"partial upload, no marker")
    assert pull_checkpoint(store, mirror, str(tmp_path / "w")) is None
    assert latest_checkpoint(tmp_path / "w") is None
