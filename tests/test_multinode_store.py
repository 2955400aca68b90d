"""What two training nodes exchange through the store, piece by piece, on moto's S3 server (fast; the
whole two-node rehearsal is tests/test_multinode.py): the launch folder (errors, rank 0's drafter), the
checkpoints every node aligns with before resuming, and the target a node without the first node's
copy rebuilds.
"""

from __future__ import annotations

import pytest

from draftflow.config import TargetConfig, TrainConfig
from draftflow.errors import ConfigError, DraftflowError
from draftflow.store import Store
from draftflow.training.checkpoint import latest_checkpoint
from draftflow.training.launch import Exchange, TrainingCrashed, _failure, _node_target
from draftflow.training.mirror import MIRROR_DONE, align_with_store, push_checkpoint


@pytest.fixture
def bucket(s3_env, request):
    name = f"nodes-{request.node.name.replace('_', '-')[:40]}"
    store = Store(f"s3://{name}/run")
    store.fs.mkdir(name)
    return store


def _error(rank: int, user: bool, t: float, msg: str) -> dict:
    return {
        "rank": rank,
        "type": "ConfigError" if user else "RuntimeError",
        "message": msg,
        "user_error": user,
        "time": t,
    }


def test_a_user_error_on_another_node_is_the_first_nodes_one_line(bucket, tmp_path):
    url = bucket.url(bucket.stage_path("train", "fp", "work", "launch"))
    first, other = Exchange(url), Exchange(url)  # two nodes: each its own view of the folder
    assert first.remote and first.errors() == []
    other.write_json("error-rank1.json", _error(1, True, 1.0, "drafter.mask_token_id=100000 is out of range"))
    first.write_json("error-rank0.json", _error(0, False, 2.0, "Connection closed by peer"))
    exc = _failure(1, first, tmp_path / "torchrun.log", [], TrainConfig())
    assert isinstance(exc, DraftflowError) and "rank 1: ConfigError: drafter.mask_token_id=100000" in str(exc)
    first.clear()  # the next attempt starts without them
    exc = _failure(1, other, tmp_path / "torchrun.log", ["killed"], TrainConfig())
    assert isinstance(exc, TrainingCrashed) and "no rank reported an error" in str(exc)


def test_rank_zeros_drafter_reaches_the_first_node_through_the_store(bucket, tmp_path):
    rank0 = tmp_path / "node-b" / "work"
    (rank0 / "launch" / "target").mkdir(parents=True)
    (rank0 / "checkpoints").mkdir()
    files = {"model.safetensors": b"weights", "config.json": b'{"a": 1}', "metrics.json": b'{"loss": 1.0}'}
    for name, data in files.items():
        (rank0 / name).write_bytes(data)
    (rank0 / "launch" / "target" / "config.json").write_text('{"model_type": "qwen3"}')
    url = bucket.url(bucket.stage_path("train", "fp", "work", "launch"))
    Exchange(url).publish(str(rank0))
    first = tmp_path / "node-a" / "work"
    Exchange(url).fetch(str(first))
    assert {p.name: p.read_bytes() for p in first.iterdir() if p.is_file()} == files
    assert (first / "launch" / "target" / "config.json").read_text() == '{"model_type": "qwen3"}'
    Exchange(url).clear()
    assert not bucket.fs.exists(f"{bucket.stage_path('train', 'fp', 'work', 'launch')}/out")


def _checkpoint(out, step: int, data: bytes):
    folder = out / "checkpoints" / f"step_{step:08d}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(data)
    return folder


def test_every_node_resumes_from_the_stores_newest_checkpoint(bucket, tmp_path):
    mirror = bucket.stage_path("train", "fp", "work", "checkpoints")
    a, b = tmp_path / "node-a", tmp_path / "node-b"
    push_checkpoint(bucket, mirror, _checkpoint(a, 2, b"step 2"))
    _checkpoint(a, 4, b"step 4, killed while copying it")  # never reached the store
    bucket.fs.pipe_file(f"{mirror}/step_00000004/model.safetensors", b"partial")  # no COMPLETE marker
    assert align_with_store(bucket, mirror, str(a)) is None  # node A already has step 2 ...
    assert latest_checkpoint(a).name == "step_00000002"  # ... and drops its unconfirmed step 4
    got = align_with_store(bucket, mirror, str(b))  # node B had nothing: it pulls step 2
    assert got is not None and (got / "model.safetensors").read_bytes() == b"step 2"
    assert not (got / MIRROR_DONE).exists()
    bucket.fs.rm(mirror, recursive=True)  # nothing in the store: no local checkpoint is trusted
    assert align_with_store(bucket, mirror, str(a)) is None and latest_checkpoint(a) is None


def test_a_node_without_the_first_nodes_tiny_target_builds_its_own(tiny_target):
    class Cfg:
        target = TargetConfig()

    ref = {"path": "/nowhere/on/this/node", "fingerprint": tiny_target.fingerprint}
    assert _node_target(Cfg, ref) == tiny_target  # rebuilt (here: found) in this node's cache
    assert _node_target(Cfg, {"path": tiny_target.path, "fingerprint": "x"}).path == tiny_target.path  # as given
    with pytest.raises(ConfigError, match="differs from the first node's"):
        _node_target(Cfg, {"path": "/nowhere", "fingerprint": "local-other"})
