"""Training metrics: TensorBoard events, JSON summary and PNG curves hold the run's values."""

from __future__ import annotations

import json

import pytest
import torch

from draftflow.training.metrics import loss_history, metrics_table, moving_average, write_metrics

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

METRICS = {"loss": 1.5, "first_loss": 5.0, "accuracy": [0.8, 0.5, 0.25], "tau_est": 2.1, "steps": 4,
           "trainable_params": 1000, "frozen_params": 20, "skipped_sequences": 0, "tokens_per_s": 123.0}
HISTORY = [5.0, None, 3.0, 2.0]


def fake_checkpoint(out_dir, history):
    """What draftflow.training.checkpoint.save_checkpoint leaves: step_N/state.pt with the loop state."""
    folder = out_dir / "checkpoints" / f"step_{len(history):08d}"
    folder.mkdir(parents=True)
    torch.save({"loop": {"step": len(history), "history": history}}, folder / "state.pt")


def scalars(run_dir, tag):
    acc = EventAccumulator(str(run_dir / "metrics" / "tensorboard"))
    acc.Reload()
    return [(e.step, pytest.approx(e.value)) for e in acc.Scalars(tag)]


def test_history_read_from_newest_checkpoint(tmp_path):
    assert loss_history(tmp_path) == []
    fake_checkpoint(tmp_path, HISTORY)
    assert loss_history(tmp_path) == HISTORY


def test_files_hold_the_values(tmp_path):
    fake_checkpoint(tmp_path, HISTORY)
    files = write_metrics(tmp_path, METRICS)
    assert {"metrics/training_metrics.json", "metrics/loss.png", "metrics/accuracy.png"} <= set(files)
    assert any(f.startswith("metrics/tensorboard/events.out.tfevents") for f in files)
    for png in ("loss.png", "accuracy.png"):
        assert (tmp_path / "metrics" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((tmp_path / "metrics" / "training_metrics.json").read_text())
    assert summary["final"] == METRICS and summary["loss_history"] == HISTORY
    assert scalars(tmp_path, "train/loss") == [(1, 5.0), (3, 3.0), (4, 2.0)]  # no point for the label-less step
    assert scalars(tmp_path, "accuracy/pos_2") == [(4, 0.5)]
    assert scalars(tmp_path, "final/tau_est") == [(4, 2.1)]
    assert scalars(tmp_path, "final/tokens_per_s") == [(4, 123.0)]


def test_metrics_files_are_the_same_bytes_on_every_write(tmp_path):
    """A resumed run rewrites them: no time, host or pid in their names or bytes (they are fingerprinted)."""
    one, two = tmp_path / "one", tmp_path / "two"
    files = write_metrics(one, METRICS, history=HISTORY)
    assert files == write_metrics(two, METRICS, history=HISTORY)
    assert "metrics/tensorboard/events.out.tfevents.draftflow" in files
    assert all((one / f).read_bytes() == (two / f).read_bytes() for f in files)


def test_without_history_still_writes(tmp_path):
    files = write_metrics(tmp_path, {**METRICS, "loss": None}, history=[])
    assert "metrics/loss.png" in files
    assert json.loads((tmp_path / "metrics" / "training_metrics.json").read_text())["loss_history"] == []


def test_table_and_smoothing():
    rows = {r["metric"]: r["value"] for r in metrics_table(METRICS)}
    assert rows["tau_est"] == 2.1 and rows["accuracy@1"] == 0.8 and rows["accuracy@3"] == 0.25
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_a_slot_no_recent_step_scored_is_left_out_not_drawn_as_zero(tmp_path):
    """EAGLE-3 under `train.gamma: measured` unrolls only the steps decoding reaches: the others are None."""
    metrics = {**METRICS, "accuracy": [0.8, 0.5, None]}
    write_metrics(tmp_path, metrics, history=HISTORY)
    assert scalars(tmp_path, "accuracy/pos_2") == [(4, 0.5)]
    with pytest.raises(KeyError):  # no point at all for the slot not scored
        scalars(tmp_path, "accuracy/pos_3")
    assert (tmp_path / "metrics" / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = {r["metric"] for r in metrics_table(metrics)}
    assert {"accuracy@1", "accuracy@2"} <= rows and "accuracy@3" not in rows
