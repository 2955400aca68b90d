"""Feature sources: samples read per step (local preads), equal to reading every shard whole."""

import pytest
import torch

from draftflow.errors import StoreError
from draftflow.feature_stream import local_source
from draftflow.features import FeatureSample, FeatureShard, read_range, write_feature_shard


def _samples(n: int, start: int = 0, taps: int = 3, width: int = 32, seed: int = 0) -> list[FeatureSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(start, start + n):
        t = 6 + (i * 5) % 17
        out.append(
            FeatureSample(
                f"s{i}",
                torch.randint(0, 300, (t,), generator=g),
                torch.rand(t, generator=g) > 0.3,
                torch.randn(t, taps, width, generator=g).to(torch.bfloat16),
            )
        )
    return out


def _same(a: FeatureSample, b: FeatureSample) -> None:
    assert a.sample_id == b.sample_id
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
    assert torch.equal(a.hidden, b.hidden)


def _shards(tmp_path, dtype: str = "bfloat16") -> tuple[list[str], list[FeatureSample]]:
    parts = [_samples(4), _samples(3, start=4, seed=1)]
    paths = []
    for k, part in enumerate(parts):
        paths.append(str(tmp_path / f"train-{k:05d}.safetensors"))
        write_feature_shard(paths[-1], part, [1, 2, 3], dtype)
    return paths, [s for part in parts for s in part]


@pytest.mark.parametrize("dtype", ["bfloat16", "float8"])
def test_source_takes_what_whole_shards_hold_in_any_order(tmp_path, dtype):
    paths, written = _shards(tmp_path, dtype)
    whole = [s for p in paths for s in FeatureShard(p)]
    source = local_source(paths)
    assert len(source) == 7 and source.sample_ids == [s.sample_id for s in written]
    assert source.lengths == [s.input_ids.numel() for s in written] and source.tokens == sum(source.lengths)
    order = [6, 0, 3, 4, 1, 5, 2]
    for i, got in zip(order, source.take(order), strict=True):
        _same(got, whole[i])
    if dtype == "bfloat16":
        _same(source[5], written[5])


def test_read_range_reads_exact_bytes_and_names_a_short_file(tmp_path):
    path = tmp_path / "blob.bin"
    data = bytes(range(256)) * 40
    path.write_bytes(data)
    assert read_range(str(path), 100, 9000) == data[100:9000]
    assert read_range(str(path), 5, 5) == b""
    with pytest.raises(StoreError, match="blob.bin ended at byte"):
        read_range(str(path), 10000, 10300)
