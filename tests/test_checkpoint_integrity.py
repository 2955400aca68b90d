"""Checkpoints that cannot lie: a torn or bit-flipped checkpoint is never trained on and never blocks a re-run."""

from __future__ import annotations

import logging

import pytest
import torch

from draftflow.training.checkpoint import CHECKSUMS, CheckpointError, checkpoint_problem
from draftflow.training.loop import train_drafter
from tests.conftest import MASK_ID, greedy_samples, preempt_training
from tests.test_train import tcfg, weights

CFG = dict(max_steps=12, checkpoint_every=4)  # checkpoints at 4 and 8 when preempted during step 11


@pytest.fixture(scope="module")
def samples(target, dcfg):
    g = torch.Generator().manual_seed(1)
    return greedy_samples(target, dcfg, torch.randint(0, MASK_ID, (6, 5), generator=g).tolist())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, target, samples, dcfg):
    out = tmp_path_factory.mktemp("whole")
    metrics = train_drafter(samples, target, dcfg, tcfg(**CFG), str(out))
    return metrics, weights(out)


def preempted_run(tmp_path, monkeypatch, target, samples, dcfg):
    restore = preempt_training(monkeypatch, at=11)
    with pytest.raises(RuntimeError, match="preempted"):
        train_drafter(samples, target, dcfg, tcfg(**CFG), str(tmp_path))
    restore()
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000004", "step_00000008"]
    return ckpts


def flip(path, where):
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x10
    path.write_bytes(bytes(data))


def truncate(path, where):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * where)])


DAMAGE = {
    "bit flip in the weights' data": lambda c: flip(c / "model.safetensors", 0.9),
    "bit flip in the optimizer state": lambda c: flip(c / "state.pt", 0.5),
    "weights torn at 1%": lambda c: truncate(c / "model.safetensors", 0.01),
    "optimizer state torn at 60%": lambda c: truncate(c / "state.pt", 0.6),
    "checksums never written": lambda c: (c / CHECKSUMS).unlink(),
    "checksums torn": lambda c: truncate(c / CHECKSUMS, 0.5),
    "meta edited": lambda c: (c / "meta.json").write_text((c / "meta.json").read_text().replace("12", "13", 1)),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_good_one(
        damage, tmp_path, monkeypatch, caplog, target, samples, dcfg, uninterrupted):
    ckpts = preempted_run(tmp_path, monkeypatch, target, samples, dcfg)
    assert checkpoint_problem(ckpts / "step_00000008") is None
    DAMAGE[damage](ckpts / "step_00000008")
    assert checkpoint_problem(ckpts / "step_00000008") is not None
    with caplog.at_level(logging.WARNING, logger="draftflow.training.checkpoint"):
        metrics = train_drafter(samples, target, dcfg, tcfg(**CFG), str(tmp_path))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "step_00000008" in warned[0] and "\n" not in warned[0]
    assert (ckpts / "corrupt_step_00000008").is_dir()  # kept for inspection, never read again
    full_metrics, full_weights = uninterrupted
    got = weights(tmp_path)
    assert set(got) == set(full_weights) and all(torch.equal(got[k], full_weights[k]) for k in got)
    assert metrics == full_metrics


def test_no_good_checkpoint_stops_in_one_line_and_the_rerun_starts_over(
        tmp_path, monkeypatch, target, samples, dcfg, uninterrupted):
    ckpts = preempted_run(tmp_path, monkeypatch, target, samples, dcfg)
    flip(ckpts / "step_00000008" / "state.pt", 0.3)
    truncate(ckpts / "step_00000004" / "model.safetensors", 0.5)
    with pytest.raises(CheckpointError) as err:
        train_drafter(samples, target, dcfg, tcfg(**CFG), str(tmp_path))
    msg = str(err.value)
    assert "\n" not in msg and "step_00000008" in msg and "step_00000004" in msg and "re-run" in msg
    metrics = train_drafter(samples, target, dcfg, tcfg(**CFG), str(tmp_path))  # from step 0
    assert metrics == uninterrupted[0]
    got = weights(tmp_path)
    assert all(torch.equal(got[k], v) for k, v in uninterrupted[1].items())


def test_every_checkpoint_lists_each_file_it_holds(tmp_path, target, samples, dcfg):
    import json

    train_drafter(samples, target, dcfg, tcfg(max_steps=4, checkpoint_every=4), str(tmp_path))
    folder = tmp_path / "checkpoints" / "step_00000004"
    listed = json.loads((folder / CHECKSUMS).read_text())
    assert set(listed) == {p.name for p in folder.iterdir()} - {CHECKSUMS}
    assert all(v["bytes"] == (folder / k).stat().st_size for k, v in listed.items())
