"""The train stage under torchrun: 2 gloo processes equal in-process training,
and a failing rank is one clear error with no manifest."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file

from draftflow.config import TrainConfig
from draftflow.errors import ConfigError, DraftflowError
from draftflow.stages import train as train_stage
from draftflow.store import Store
from draftflow.training.launch import TrainingCrashed, use_torchrun
from tests.conftest import one_shard_features, stamped, tiny_config

TRAIN = ["train.max_steps=4", "train.batch_size=3", "train.checkpoint_every=2", "train.num_anchors=8"]


@pytest.fixture(scope="module")
def front(tmp_path_factory, tiny_target):
    """Features of one train shard of the tiny run, with a complete extract manifest."""
    root = tmp_path_factory.mktemp("launch") / "run"
    cfg = tiny_config(root, *TRAIN)
    return root, one_shard_features(cfg, tiny_target)[1]


def _train(root, tiny_target, features, fp, *overrides):
    cfg = tiny_config(root, *TRAIN, *overrides)
    return train_stage.run(Store(cfg.root), stamped("train", fp, {"extract": "d"}), cfg, tiny_target, features)


def _weights(root, fp):
    return load_file(str(root / "train" / fp / "checkpoint" / "model.safetensors"))


def test_torchrun_stage_equals_in_process_training(front, tiny_target, caplog):
    # FSDP2 under 2 ranks (and resume across modes) is tested in test_distributed.py, without torchrun's startup.
    root, features = front
    one = _train(root, tiny_target, features, "fp-one")  # CPU, 1 process: in-process
    with caplog.at_level(logging.INFO, logger="draftflow.training.launch"):
        ddp = _train(root, tiny_target, features, "fp-ddp", "train.nproc_per_node=2")
    assert "[rank 0]" in caplog.text and "[rank 1]" in caplog.text  # two real processes, their output logged
    # A complete stage keeps no work folder (its launch/torchrun.log goes with it; a failed one keeps it).
    assert not (root / "train" / "fp-one" / "work").exists() and not (root / "train" / "fp-ddp" / "work").exists()
    assert ddp.rows_out == one.rows_out and ddp.extra["trained_tokens"] == one.extra["trained_tokens"]
    assert ddp.extra["metrics"]["steps"] == 4
    assert ddp.extra["metrics"]["loss"] == pytest.approx(one.extra["metrics"]["loss"], rel=1e-4)
    w1, w2 = _weights(root, "fp-one"), _weights(root, "fp-ddp")
    assert set(w2) == set(w1)
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=2e-5, rtol=1e-4)
    for name in ("export/vllm/config.json", "export/speculators/config.json"):  # the target config as loaded
        assert (root / "train" / "fp-ddp" / name).read_text() == (root / "train" / "fp-one" / name).read_text()


def _assert_failed_cleanly(exc_info, root, fp, *needles):
    msg = str(exc_info.value)
    assert "\n" not in msg and "exit code 1" in msg and "torchrun.log" in msg, msg
    for needle in needles:
        assert needle in msg, msg
    assert not (root / "train" / fp / "manifest.json").exists()  # nothing looks complete
    assert not (root / "train" / fp / "checkpoint").exists()


def test_a_rank_crash_is_one_line_with_the_exit_code_and_log_and_no_manifest(front, tiny_target, tmp_path):
    root, features = front
    copy = tmp_path / "run"
    shutil.copytree(root / "extract", copy / "extract")
    shard = features.shards[0].name
    (copy / "extract" / "exfp" / shard).unlink()  # the ranks find it gone
    with pytest.raises(TrainingCrashed) as info:
        _train(copy, tiny_target, features, "fp-gone", "train.nproc_per_node=2")
    _assert_failed_cleanly(info, copy, "fp-gone", "FileNotFoundError", shard)


def test_a_user_error_in_a_rank_is_a_draftflow_error(front, tiny_target):
    root, features = front
    with pytest.raises(DraftflowError) as info:  # found only where the drafter is built: in the rank
        _train(root, tiny_target, features, "fp-mask", "train.launcher=torchrun", "drafter.mask_token_id=100000")
    _assert_failed_cleanly(info, root, "fp-mask", "ConfigError", "drafter.mask_token_id=100000")


def test_timeout_kills_the_ranks(front, tiny_target):
    root, features = front
    with pytest.raises(TrainingCrashed, match=r"train.timeout_s=0.5"):
        _train(root, tiny_target, features, "fp-slow", "train.nproc_per_node=2", "train.timeout_s=0.5")
    assert not (root / "train" / "fp-slow" / "manifest.json").exists()


def test_launcher_choice():
    assert not use_torchrun(TrainConfig(device="cpu"))
    assert use_torchrun(TrainConfig(device="cpu", nproc_per_node=2))
    assert use_torchrun(TrainConfig(device="cpu", launcher="torchrun"))
    assert use_torchrun(TrainConfig(device="cuda"))  # a GPU trains in its own process
    assert not use_torchrun(TrainConfig(device="cuda", launcher="inprocess"))
    with pytest.raises(ConfigError, match="train.launcher=inprocess"):
        use_torchrun(TrainConfig(nproc_per_node=2, launcher="inprocess"))


def test_the_failing_rank_is_the_one_reported_not_its_peers(tmp_path):
    """A user error on rank 1 makes rank 0 fail in its next collective; the user error is what counts."""
    import json

    from draftflow.config import TrainConfig
    from draftflow.training.launch import _failure

    def errors(*rows):
        for f in tmp_path.glob("error-rank*.json"):
            f.unlink()
        for rank, user, t, msg in rows:
            (tmp_path / f"error-rank{rank}.json").write_text(json.dumps(
                {"rank": rank, "type": "ConfigError" if user else "RuntimeError", "message": msg,
                 "user_error": user, "time": t}))
        return _failure(1, tmp_path, tmp_path / "torchrun.log", [], TrainConfig())

    exc = errors((0, False, 2.0, "Connection closed by peer"), (1, True, 1.0, "rank 1 had no sequence"))
    assert isinstance(exc, DraftflowError) and "rank 1: ConfigError: rank 1 had no sequence" in str(exc)
    exc = errors((0, False, 5.0, "Connection closed by peer"), (1, False, 3.0, "CUDA out of memory"))
    assert isinstance(exc, TrainingCrashed) and "rank 1: RuntimeError: CUDA out of memory" in str(exc)
