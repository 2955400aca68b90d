"""Extract faults: SIGKILL mid-shard resumes from its parts; a bad shard is found and recomputed."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftflow.errors import StoreError
from draftflow.features import FeatureShard
from draftflow.stages import extract
from draftflow.stages.common import Source
from tests.conftest import run_front, tiny_config
from tests.reliability.killable import kill_when_frozen

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = """
import sys, json, torch
torch.set_num_threads(1)
from draftflow.config import RunConfig
from draftflow.stages import extract
from draftflow.stages.common import Source
from draftflow.store import Store
from draftflow.target import TargetRef
from tests.reliability.killable import arm_call
arm_call("draftflow.stages.extract", "_save_part", 3, sys.argv[3])  # two checkpoints are on disk
from draftflow.contracts import ShardEntry
cfg = RunConfig.model_validate_json(open(sys.argv[1]).read())
args = json.load(open(sys.argv[2]))
extract.run_shard(Store(cfg.root), "killed", cfg, TargetRef(**args["target"]), Source("tokenize", "tokfp"),
                  ShardEntry.model_validate(args["shard"]))
"""


@pytest.fixture(scope="module")
def front(tmp_path_factory, tiny_target):
    cfg = tiny_config(tmp_path_factory.mktemp("extract") / "run", "extract.checkpoint_every=3",
                      "extract.batch_size=2")
    store, _, _, _, tres = run_front(cfg, tiny_target)
    reference = extract.run_shard(store, "reference", cfg, tiny_target, Source("tokenize", "tokfp"), tres.shard)
    return cfg, store, tres.shard, reference


def _shard(store, fp, result):
    return FeatureShard(store.stage_path("extract", fp, result.shard.name))


def test_sigkill_mid_shard_then_rerun_equals_an_uninterrupted_run(tmp_path, front, tiny_target):
    cfg, store, shard, reference = front
    (tmp_path / "cfg.json").write_text(cfg.model_dump_json())
    (tmp_path / "args.json").write_text(json.dumps({"target": {"path": tiny_target.path,
                                                               "fingerprint": tiny_target.fingerprint},
                                                    "shard": shard.to_json()}))
    marker = tmp_path / "frozen"
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path / "cfg.json"), str(tmp_path / "args.json"),
                             str(marker)], cwd=ROOT)
    partial = Path(store.stage_path("extract", "killed", "partial", "train-00000"))
    kill_when_frozen(proc, marker)  # frozen before its third checkpoint
    assert proc.returncode == -signal.SIGKILL
    assert len(list(partial.glob("part-*.safetensors"))) == 2
    done_before = sum(len(FeatureShard(p)) for p in partial.glob("part-*.safetensors"))
    assert 0 < done_before < shard.rows  # killed mid-shard, after checkpoints
    assert not Path(store.stage_path("extract", "killed", reference.shard.name)).exists()

    resumed = extract.run_shard(store, "killed", cfg, tiny_target, Source("tokenize", "tokfp"), shard)
    got, want = _shard(store, "killed", resumed), _shard(store, "reference", reference)
    assert got.sample_ids == want.sample_ids  # input order, no loss, no duplicate
    for a, b in zip(got, want):
        torch.testing.assert_close(a.hidden, b.hidden, atol=1e-6, rtol=1e-6)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
    assert not partial.exists()  # the parts are cleared once the shard is committed


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_shard_fails_its_checksum_and_is_recomputed(front, tiny_target, damage):
    cfg, store, shard, _ = front
    result = extract.run_shard(store, f"dmg-{damage}", cfg, tiny_target, Source("tokenize", "tokfp"), shard)
    entry, fp = result.shard, f"dmg-{damage}"
    path = Path(store.stage_path("extract", fp, entry.name))
    assert extract.bad_shards(store, fp, [entry]) == []
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
        with pytest.raises(StoreError, match="truncated"):
            FeatureShard(path)
    else:
        data[len(data) // 2] ^= 0x40
        path.write_bytes(data)
        with pytest.raises(StoreError, match="checksum"):
            FeatureShard(path, sha256=entry.sha256)
    assert extract.bad_shards(store, fp, [entry]) == [entry.name]
    # Reusing a complete stage checks sizes only: a truncation is caught there, a same-size
    # flip by the hash of whoever reads the shard (train's verify_sha).
    assert extract.bad_shards(store, fp, [entry], checksum=False) == ([entry.name] if damage == "truncate" else [])
    if damage == "flip":
        with pytest.raises(StoreError, match="checksum"):
            store.verify_sha("extract", fp, entry)
    again = extract.run_shard(store, fp, cfg, tiny_target, Source("tokenize", "tokfp"), shard)  # what the flow re-runs
    assert again.shard.sha256 == entry.sha256  # deterministic: the same bytes as before
    assert extract.bad_shards(store, fp, [again.shard]) == []


def test_fp8_shard_from_the_stage(front, tiny_target):
    cfg, store, shard, reference = front
    cfg8 = cfg.model_copy(update={"extract": cfg.extract.model_copy(update={"dtype": "float8"})})
    result = extract.run_shard(store, "fp8", cfg8, tiny_target, Source("tokenize", "tokfp"), shard)
    got, want = _shard(store, "fp8", result), _shard(store, "reference", reference)
    assert result.shard.dtype == "float8" and got.dtype == "float8"
    assert result.shard.bytes < reference.shard.bytes
    a, b = got.get(0).hidden.float(), want.get(0).hidden.float()
    assert (a - b).abs().max() <= b.abs().amax(-1, keepdim=True).max() * 2 ** -4


def test_parts_and_shard_on_s3_equal_the_local_run(front, tiny_target, s3_env):
    import s3fs

    from draftflow.store import Store

    cfg, store, shard, reference = front
    fs = s3fs.S3FileSystem()
    fs.mkdir("extract-s3")
    s3 = Store("s3://extract-s3/run")
    fs.put_file(store.stage_path("tokenize", "tokfp", shard.name), s3.stage_path("tokenize", "tokfp", shard.name))
    # 7 parts on S3, then merged
    result = extract.run_shard(s3, "fp", cfg, tiny_target, Source("tokenize", "tokfp"), shard)
    url = s3.url(s3.stage_path("extract", "fp", result.shard.name))
    got = FeatureShard(url, sha256=result.shard.sha256)
    want = _shard(store, "reference", reference)
    assert got.sample_ids == want.sample_ids and not fs.exists("extract-s3/run/extract/fp/partial/train-00000")
    torch.testing.assert_close(got.get(3).hidden, want.get(3).hidden, atol=1e-6, rtol=1e-6)
    assert extract.bad_shards(s3, "fp", [result.shard]) == []
