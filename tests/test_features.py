"""Feature shards: formats, bytes per token, random access, streaming, merge, faults, S3."""

import os
import random

import pytest
import torch
from safetensors import safe_open

from draftflow.contracts import ShardEntry
from draftflow.errors import StoreError
from draftflow.features import (
    FeatureSample,
    FeatureShard,
    merge_feature_shards,
    round_trip,
    sha256_of,
    write_feature_shard,
)


def _samples(n=6, taps=3, width=64, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = 5 + (i * 7) % 23
        hidden = (torch.randn(t, taps, width, generator=g) * scale).to(torch.bfloat16)
        out.append(FeatureSample(f"s{i}:0", torch.randint(0, 150000, (t,), generator=g),
                                 torch.rand(t, generator=g) > 0.3, hidden))
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_plain_dtypes_round_trip_exactly(tmp_path, dtype):
    samples = _samples()
    tokens = write_feature_shard(tmp_path / "f.safetensors", samples, [1, 3, 5], dtype)
    shard = FeatureShard(tmp_path / "f.safetensors")
    assert tokens == sum(len(s.input_ids) for s in samples) and shard.layer_ids == [1, 3, 5] and len(shard) == 6
    for s in random.Random(0).sample(samples, len(samples)):  # random access by sample id
        got = shard.get(s.sample_id)
        assert torch.equal(got.hidden.float(), s.hidden.float()) and got.hidden.dtype == getattr(torch, dtype)
        assert torch.equal(got.input_ids, s.input_ids) and torch.equal(got.loss_mask, s.loss_mask)
    assert [g.sample_id for g in shard] == [s.sample_id for s in samples]  # streaming, stored order


def test_fp8_reads_dequantize_to_bf16_within_e4m3_precision(tmp_path):
    samples = _samples()
    samples[0].hidden[2] = 0  # an all-zero row must not become NaN
    write_feature_shard(tmp_path / "f.safetensors", samples, [1, 3, 5], "float8")
    shard = FeatureShard(tmp_path / "f.safetensors")
    for s in samples:
        got = shard.get(s.sample_id).hidden
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        amax = s.hidden.float().abs().amax(-1, keepdim=True)
        # e4m3: 3 mantissa bits, so |error| <= 2^-4 of the value, and values are scaled to the row max
        assert ((got.float() - s.hidden.float()).abs() <= amax * 2 ** -4 + 1e-6).all()
    assert torch.equal(shard.get("s0:0").hidden[2], torch.zeros_like(shard.get("s0:0").hidden[2]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float8"])
def test_eval_rounding_equals_what_training_reads(tmp_path, dtype):
    s = _samples(n=1, taps=2, width=32)[0]
    s.hidden = s.hidden.float() * 1.2345  # full-precision features, as the target computes them
    write_feature_shard(tmp_path / "f.safetensors", [s], [1, 2], dtype)
    stored = FeatureShard(tmp_path / "f.safetensors").get(0).hidden.float().reshape(len(s.input_ids), -1)
    flat = s.hidden.reshape(len(s.input_ids), -1)
    assert torch.equal(round_trip(flat, dtype, 2), stored)
    # evaluate rounds its live features with round_trip: equal to what a shard reader gets
    assert torch.equal(round_trip(flat, dtype, 2).to(torch.float32), stored)


@pytest.mark.parametrize("dtype, size", [("bfloat16", 2), ("float8", 1)])
@pytest.mark.parametrize("taps, width", [(5, 1024), (1, 1024), (5, 4096)])
def test_bytes_per_token_within_one_percent_of_raw(tmp_path, dtype, size, taps, width):
    g = torch.Generator().manual_seed(0)
    samples = [FeatureSample(f"conversation-{i:08d}:{i % 3}", torch.randint(0, 150000, (512,), generator=g),
                             torch.ones(512, dtype=torch.bool), torch.randn(512, taps, width, generator=g))
               for i in range(4)]
    tokens = write_feature_shard(tmp_path / "f.safetensors", samples, list(range(taps)), dtype)
    per_token = os.path.getsize(tmp_path / "f.safetensors") / tokens
    raw = taps * width * size
    assert per_token / raw < 1.01, f"{dtype} {taps}x{width}: {per_token:.1f} B/token vs raw {raw}"


def test_files_are_standard_safetensors(tmp_path):
    write_feature_shard(tmp_path / "f.safetensors", _samples(), [1, 3, 5], "float8")
    with safe_open(str(tmp_path / "f.safetensors"), framework="pt") as f:
        assert set(f.keys()) == {"hidden_states", "scales", "input_ids", "loss_mask", "offsets"}
        assert f.get_tensor("hidden_states").dtype == torch.float8_e4m3fn
        assert f.metadata()["dtype"] == "float8"


@pytest.mark.parametrize("dtype", ["bfloat16", "float8"])
def test_merged_parts_equal_one_shard_written_at_once(tmp_path, dtype):
    samples = _samples(n=7)
    write_feature_shard(tmp_path / "whole.safetensors", samples, [1, 3, 5], dtype)
    write_feature_shard(tmp_path / "a.safetensors", samples[4:], [1, 3, 5], dtype)  # parts in any order
    write_feature_shard(tmp_path / "b.safetensors", samples[:4], [1, 3, 5], dtype)
    parts = [FeatureShard(tmp_path / "a.safetensors"), FeatureShard(tmp_path / "b.safetensors")]
    merge_feature_shards(tmp_path / "merged.safetensors", parts, [s.sample_id for s in samples])
    assert (tmp_path / "merged.safetensors").read_bytes() == (tmp_path / "whole.safetensors").read_bytes()
    with pytest.raises(StoreError, match="missing"):
        merge_feature_shards(tmp_path / "x.safetensors", parts[:1], [s.sample_id for s in samples])


def test_truncated_or_corrupted_shards_raise_store_error(tmp_path):
    path = tmp_path / "f.safetensors"
    write_feature_shard(path, _samples(), [1, 3, 5])
    good = sha256_of(str(path))
    FeatureShard(path, sha256=good)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(data)
    with pytest.raises(StoreError, match="checksum"):
        FeatureShard(path, sha256=good)
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(StoreError, match="truncated"):
        FeatureShard(path)  # caught without a hash: the size disagrees with the header
    path.write_bytes(b"\x00" * 3)
    with pytest.raises(StoreError):
        FeatureShard(path)


def test_reads_from_s3_directly_and_through_the_store(tmp_path, s3_env):
    import s3fs

    from draftflow.store import Store

    fs = s3fs.S3FileSystem()
    fs.mkdir("features")
    samples = _samples(n=5)
    write_feature_shard(tmp_path / "f.safetensors", samples, [1, 3, 5], "float8")
    digest = sha256_of(str(tmp_path / "f.safetensors"))
    fs.put_file(str(tmp_path / "f.safetensors"), "features/run/extract/fp/train-00000.safetensors")
    local = FeatureShard(tmp_path / "f.safetensors")

    remote = FeatureShard("s3://features/run/extract/fp/train-00000.safetensors", sha256=digest)  # ranged reads
    assert torch.equal(remote.get("s3:0").hidden, local.get("s3:0").hidden)
    assert [s.sample_id for s in remote] == [s.sample_id for s in samples]

    store = Store("s3://features/run")
    entry = ShardEntry(name="train-00000.safetensors", rows=len(samples), bytes=1, sha256=digest)
    copy = FeatureShard(store.verify_sha("extract", "fp", entry))  # the store's local copy
    assert torch.equal(copy.get(1).hidden, local.get(1).hidden)
