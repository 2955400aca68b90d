"""Online features (`extract.mode: online`): computed per step by the co-located target,
equal to what extract would have stored, and enough to train a drafter."""

from __future__ import annotations

import pytest
import torch

from draftflow.contracts import Manifest, StageResult, feature_source
from draftflow.errors import ConfigError
from draftflow.features import FeatureShard
from draftflow.runs.plan import preflight
from draftflow.stages import extract
from draftflow.stages import train as train_stage
from draftflow.stages.common import Source, manifest_digest
from draftflow.stages.registry import stamp
from draftflow.training.job import OnlineSamples
from tests.conftest import run_front, tiny_config


@pytest.fixture(scope="module")
def front(tmp_path_factory, tiny_target):
    """curate -> regenerate -> tokenize on one train shard of the tiny run."""
    cfg = tiny_config(tmp_path_factory.mktemp("online") / "run")
    store, _, _, _, tres = run_front(cfg, tiny_target)
    return cfg, store, tres.shard


def _online(cfg, store, tok_shard, tiny_target, *overrides):
    cfg = tiny_config(cfg.root, "extract.mode=online", *overrides)
    manifest = Manifest(stage="tokenize", fingerprint="tokfp", code_version="c", config={}, inputs={},
                        shards=(tok_shard,), rows_in=tok_shard.rows, rows_out=tok_shard.rows, dropped={}, tokens=0)
    tokenized = StageResult(stage="tokenize", fingerprint="tokfp", status="ran", digest="d", path="p",
                            manifest=manifest)
    inputs = {"target": tiny_target.fingerprint, "tokenize": "d"}
    handed = stamp(cfg, "extract", inputs)
    return cfg, extract.online_manifest(store, handed, cfg, tokenized), handed.fingerprint


def test_online_extract_stores_nothing_and_points_at_the_sequences_it_was_handed(front, tiny_target):
    cfg, store, tok = front
    ocfg, m, xfp = _online(cfg, store, tok, tiny_target)
    assert m.shards == () and m.extra["mode"] == "online"
    assert m.rows_out == tok.rows and m.extra["tokens"] == tok.tokens
    assert m.extra["sequences"] == {"stage": "tokenize", "fingerprint": "tokfp", "shards": [tok.to_json()]}
    assert store.read_manifest("extract", xfp) == m  # complete: a rerun reuses it


@pytest.mark.parametrize("dtype", ["bfloat16", "float8"])
def test_online_tensors_equal_the_stored_ones_for_the_same_batch(front, tiny_target, dtype):
    cfg, store, tok = front
    xcfg = tiny_config(cfg.root, f"extract.dtype={dtype}")
    res = extract.run_shard(store, f"ex-{dtype}", xcfg, tiny_target, Source("tokenize", "tokfp"), tok)
    stored = FeatureShard(store.stage_path("extract", f"ex-{dtype}", res.shard.name))
    ocfg = tiny_config(cfg.root, "extract.mode=online", f"extract.dtype={dtype}")
    path = store.verify_sha("tokenize", "tokfp", tok)
    online = OnlineSamples.from_parquet([path], tiny_target, ocfg, stored.layer_ids)
    assert online.sample_ids == stored.sample_ids and len(online) == len(stored)
    # The whole shard in one take: the same length-sorted batches extract ran.
    for got in online.take(list(range(len(online)))):
        want = stored.get(got.sample_id)
        assert got.hidden.dtype == want.hidden.dtype and torch.equal(got.hidden, want.hidden)
        assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.loss_mask, want.loss_mask)
    # A training step's own batch pads differently: equal up to one rounding step of the dtype.
    for got in online.take([5, 0, 3]):
        want = stored.get(got.sample_id).hidden.float()
        torch.testing.assert_close(got.hidden.float(), want, atol=0.02 + 0.07 * (dtype == "float8"), rtol=0.07)


def test_a_short_online_training_run_writes_a_checkpoint(front, tiny_target):
    cfg, store, tok = front
    ocfg, m, xfp = _online(cfg, store, tok, tiny_target, "train.max_steps=3", "train.checkpoint_every=2")
    inputs = {"target": tiny_target.fingerprint, "extract": manifest_digest(m)}
    handed = stamp(ocfg, "train", inputs)
    tfp = handed.fingerprint
    extracted = StageResult(stage="extract", fingerprint=xfp, status="ran", digest="d", path="p", manifest=m)
    out = train_stage.run(store, handed, ocfg, tiny_target, feature_source(extracted))
    assert out.extra["features"] == "online" and out.extra["metrics"]["steps"] == 3
    assert out.extra["trained_tokens"] == tok.tokens and out.rows_out == tok.rows
    ckpt = store.stage_path("train", tfp, "checkpoint", "model.safetensors")
    assert store.exists(ckpt) and store.read_manifest("train", tfp) == out


def test_online_mode_needs_the_hf_engine_on_the_training_device(tmp_path, tiny_target):
    with pytest.raises(ConfigError, match="extract.engine=hf"):
        preflight(tiny_config(tmp_path / "r", "extract.mode=online", "extract.engine=vllm"))
    with pytest.raises(ConfigError, match="target on the training device"):
        extract.check_online(tiny_config(tmp_path / "r", "extract.mode=online", "target.device=cpu",
                                             "train.device=cuda:1"))
