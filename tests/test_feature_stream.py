"""Feature sources: samples read per step (local preads, or ranged GETs from S3 verified per read
through a bounded cache), equal to reading every shard whole."""

import json
import os
import struct
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from draftflow.config import DrafterConfig, TrainConfig
from draftflow.contracts import ShardEntry
from draftflow.drafters.dflash.config import DFlashConfig
from draftflow.errors import StoreError
from draftflow.feature_stream import RangeCache, local_source, open_features
from draftflow.features import FeatureSample, FeatureShard, read_range, sha256_of, write_feature_shard
from draftflow.store import Store
from draftflow.training.loop import train_drafter
from tests.conftest import MASK_ID, moto_s3
from tests.reliability.faulty_s3 import FaultyProxy


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


# -- checksums in the index (format v3) and v2 shards -----------------------------------------------
def _as_v2(path) -> None:
    """Rewrite a shard as format v2 wrote it: no per-sample checksums in the index."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["__metadata__"]["format"] = "draftflow.features.v2"
    del header["__metadata__"]["sample_sha256"]
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def _flip(path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_each_read_is_verified_against_the_index_and_v2_shards_stay_readable(tmp_path):
    paths, written = _shards(tmp_path)
    shard = FeatureShard(paths[0])
    assert shard.sample_sha256 is not None and len(shard.sample_sha256) == 4
    _same(shard.get(2, verify=True), written[2])
    start, end = shard.ranges(2)[0]  # sample 2's hidden states
    _flip(Path(paths[0]), (start + end) // 2)
    with pytest.raises(StoreError, match="sample 's2' of feature shard .* fails its checksum"):
        FeatureShard(paths[0]).get(2, verify=True)
    _same(FeatureShard(paths[0]).get(1, verify=True), written[1])  # the others still read

    _as_v2(Path(paths[1]))
    old = FeatureShard(paths[1])
    assert old.sample_sha256 is None
    _same(old.get(0), written[4])
    (tmp_path / "again").mkdir()
    assert old.digest(0) == FeatureShard(_shards(tmp_path / "again")[0][1]).digest(0)  # computed = stored
    with pytest.raises(StoreError, match="no per-sample checksums"):
        old.get(0, verify=True)


def _entry(store: Store, local: str, name: str) -> ShardEntry:
    store.fs.put_file(local, store.stage_path("extract", "fp", name))
    return ShardEntry(name=name, rows=len(FeatureShard(local)), sha256=sha256_of(local), bytes=os.path.getsize(local))


def _index_bytes(path: str) -> int:
    """Bytes of a shard's index a reader fetches: length, header, offsets tensor."""
    shard = FeatureShard(path)
    return sum(b - a for a, b in [(0, 8), (8, shard._start), shard._span("offsets", 0, len(shard) + 1)])


class CountingProxy(FaultyProxy):
    """A proxy in front of S3 that counts the body bytes of every GET, per object path."""

    def __init__(self, upstream: str):
        super().__init__(upstream)
        self.served: Counter = Counter()

    def handle(self, req) -> None:
        # One handler serves every request of a keep-alive connection: wrap its send_header once.
        req.counted_name = urlsplit(req.path).path.rsplit("/", 1)[-1] if req.command == "GET" else None
        if not hasattr(req, "plain_send_header"):
            req.plain_send_header = req.send_header

            def counted(key, value):
                if key.lower() == "content-length" and req.counted_name:
                    with self.lock:
                        self.served[req.counted_name] += int(value)
                req.plain_send_header(key, value)

            req.send_header = counted
        super().handle(req)


@pytest.fixture(scope="module")
def counted_s3():
    """moto behind a counting proxy; s3fs talks to the proxy (children spawned meanwhile too)."""
    import s3fs

    with moto_s3() as endpoint:
        proxy = CountingProxy(endpoint)
        with proxy as url:
            os.environ["AWS_ENDPOINT_URL"] = url
            s3fs.S3FileSystem.clear_instance_cache()
            try:
                yield proxy
            finally:
                os.environ["AWS_ENDPOINT_URL"] = endpoint
                s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.slow  # ~45 GETs through the proxy: 5 s on a loaded machine
def test_remote_reads_are_ranged_cached_bounded_and_verified(tmp_path, counted_s3):
    paths, written = _shards(tmp_path)
    store = Store("s3://feat-ranged/run")  # moto's buckets outlive its server: one name per test
    store.fs.mkdir("feat-ranged")
    entries = [_entry(store, p, f"train-{k:05d}.safetensors") for k, p in enumerate(paths)]
    cache = RangeCache(tmp_path / "cache", 10**9)
    assert open_features(store, "extract", "fp", entries, RangeCache(tmp_path / "other", 10**9)).verify == [True, True]
    counted_s3.served.clear()
    source = open_features(store, "extract", "fp", entries, cache)
    assert sum(counted_s3.served.values()) == sum(_index_bytes(p) for p in paths)  # the indexes only
    for s, got in zip(written, source.take(range(len(source))), strict=True):
        _same(got, s)
    total = sum(os.path.getsize(p) for p in paths)
    assert sum(counted_s3.served.values()) == total  # every byte once, no read-ahead past a range
    source.take([3, 0, 6])
    assert sum(counted_s3.served.values()) == total  # served from the cache
    assert cache.used == total

    # A damaged cache entry is read again from the store; a damaged object fails its check.
    start, end = source.shards[0].ranges(3)[0]
    entry = cache.folder / source.shards[0].reader.cache_key(start, end)
    _flip(entry, 0)
    _same(source.take([3])[0], written[3])
    assert sum(counted_s3.served.values()) == total + sum(b - a for a, b in source.shards[0].ranges(3))

    # A small cache keeps at most its limit.
    small = RangeCache(tmp_path / "small", 4096)
    open_features(store, "extract", "fp", entries, small).take([0, 5, 2])
    assert small.used <= 4096 and sum(f.stat().st_size for f in small.folder.rglob("*.bin")) <= 4096


def test_v2_shards_on_s3_are_downloaded_whole_and_checked_by_sha256(tmp_path, counted_s3, monkeypatch):
    monkeypatch.setenv("DRAFTFLOW_CACHE", str(tmp_path / "draftflow-cache"))  # no earlier download (Store.local_path)
    paths, written = _shards(tmp_path)
    _as_v2(Path(paths[1]))
    store = Store("s3://feat-v2/run")
    store.fs.mkdir("feat-v2")
    entries = [_entry(store, p, f"train-{k:05d}.safetensors") for k, p in enumerate(paths)]
    counted_s3.served.clear()
    source = open_features(store, "extract", "fp", entries, RangeCache(tmp_path / "cache", 10**9))
    assert source.verify == [True, False]
    assert counted_s3.served["train-00001.safetensors"] == _index_bytes(paths[1]) + os.path.getsize(paths[1])
    _same(source.take([5])[0], written[5])
    bad = entries[1].model_copy(update={"sha256": "0" * 64})
    with pytest.raises(StoreError, match="fails its checksum"):
        open_features(store, "extract", "fp", [bad], RangeCache(tmp_path / "cache2", 10**9))


# -- two ranks streaming from S3 ------------------------------------------------------------------
def _train_cfgs(target):
    dcfg = DFlashConfig.from_target(target.config, DrafterConfig(num_layers=1, block_size=4, num_taps=3), MASK_ID)
    tcfg = TrainConfig(
        epochs=1, batch_size=4, lr=3e-3, num_anchors=6, checkpoint_every=2, device="cpu", seed=0, nproc_per_node=2,
        recipe="paper",  # no held-out measurement: its reads would count against "every sample read once"
    )
    return dcfg, tcfg  # one epoch: every sample is trained on once, by one rank


def _train_shards(folder) -> list[str]:
    """12 sequences of the tiny target's width (3 taps x 64) in 3 shards, mixed lengths."""
    g = torch.Generator().manual_seed(0)
    paths = []
    for k in range(3):
        samples = [
            FeatureSample(
                f"s{i}",
                torch.randint(0, MASK_ID, (14 + 2 * i,), generator=g),
                torch.arange(14 + 2 * i) >= 3,
                torch.randn(14 + 2 * i, 3, 64, generator=g),
            )
            for i in range(4 * k, 4 * k + 4)
        ]
        paths.append(str(folder / f"train-{k:05d}.safetensors"))
        write_feature_shard(paths[-1], samples, [1, 2, 3], "float32")
    return paths


def _stream_rank(
    rank: int, world: int, rendezvous: str, target, root: str, entries: list, out: str, caches: str
) -> None:
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), DRAFTFLOW_CACHE=f"{caches}/rank{rank}")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        dcfg, tcfg = _train_cfgs(target)
        train_drafter(open_features(Store(root), "extract", "fp", entries), target, dcfg, tcfg, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_stream_each_sample_byte_once_and_train_as_from_local_disk(tmp_path, target, counted_s3):
    paths = _train_shards(tmp_path)
    store = Store("s3://feat-ranks/run")
    store.fs.mkdir("feat-ranks")
    entries = [_entry(store, p, os.path.basename(p)) for p in paths]
    counted_s3.served.clear()
    args = (
        2,
        str(tmp_path / "rendezvous"),
        target,
        "s3://feat-ranks/run",
        entries,
        str(tmp_path / "two"),
        str(tmp_path / "caches"),
    )
    mp.spawn(_stream_rank, args=args, nprocs=2, join=True)
    for p in paths:  # every sample byte once over both ranks; each rank read the index (once: it is cached)
        assert counted_s3.served[os.path.basename(p)] == os.path.getsize(p) + _index_bytes(p), p
    assert set(counted_s3.served) == {os.path.basename(p) for p in paths}  # no whole-object download

    dcfg, tcfg = _train_cfgs(target)
    train_drafter(local_source(paths), target, dcfg, tcfg, str(tmp_path / "local"))
    local = load_file(str(tmp_path / "local" / "model.safetensors"))
    streamed = load_file(str(tmp_path / "two" / "model.safetensors"))
    assert set(local) == set(streamed)
    for k in local:
        torch.testing.assert_close(streamed[k], local[k], atol=2e-5, rtol=1e-4)
