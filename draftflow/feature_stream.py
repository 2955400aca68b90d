"""Training samples read on demand from feature shards: what the trainer iterates over.

`FeatureReader` holds only the shards' indexes (sample ids, offsets, checksums); `take(indices)`
reads the samples of one step, each as a few large reads (one per stored tensor range, see
`draftflow.features`) in reader threads, several in flight, and `prefetch(indices)` starts the
next step's reads while the trainer computes. Nothing is loaded up front, so a rank holds about two steps
of features, not the dataset, and under torchrun each rank reads only its share of each step.

Streaming (issue 16): on a remote root (`s3://…`) a shard is not downloaded. Its index is read
by ranged GETs, then each sample by ranged GETs of its byte ranges, verified against the
per-sample sha256 in the index (format v3), and kept in a bounded local cache
(`RangeCache`). `open_shard` is the one place that decides how a shard is verified: per read
when its index has checksums, else (v2 shards) whole, by the store's download-and-sha256 path.

Cache size: `DRAFTFLOW_FEATURE_CACHE_GB` (default 16), per node cache folder
`<DRAFTFLOW_CACHE>/features`. An environment setting rather than a config field because it is
a property of the node's disk, not of the run (and it must not change any fingerprint).

This module knows nothing of models or of the training loop beyond the source protocol the
loop consumes (`__len__`, `sample_ids`, `lengths`, `take`, `prefetch`).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from draftflow.contracts import ShardEntry
from draftflow.errors import StoreError
from draftflow.features import FeatureSample, FeatureShard
from draftflow.kept import default_cache_dir
from draftflow.store import Store

CACHE_ENV = "DRAFTFLOW_FEATURE_CACHE_GB"
DEFAULT_CACHE_GB = 16.0
READERS = 4  # sample reads in flight per source


class RangeCache:
    """A bounded folder of byte ranges read from remote shards, least recently used evicted first.

    Keys name content (the shard's sha256 and the range), so a rewritten shard never hits a
    stale entry. Files already in the folder count against the limit (oldest first); several
    processes of a node may share the folder (writes are atomic; a file another process evicted
    is a miss). A range larger than the whole limit is not kept.
    """

    def __init__(self, folder: str | Path, limit_bytes: int):
        self.folder, self.limit = Path(folder), int(limit_bytes)
        self._lru: OrderedDict[Path, int] = OrderedDict()
        self._lock = threading.Lock()
        self.folder.mkdir(parents=True, exist_ok=True)
        for p in sorted(self.folder.rglob("*.bin"), key=lambda p: p.stat().st_mtime):
            self._lru[p] = p.stat().st_size
        self.used = sum(self._lru.values())
        self._evict()

    def get(self, key: str) -> bytes | None:
        path = self.folder / key
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        with self._lock:
            self.used += len(data) - self._lru.pop(path, 0)
            self._lru[path] = len(data)
        return data

    def put(self, key: str, data: bytes) -> None:
        if len(data) > self.limit:
            return
        path = self.folder / key
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.part")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        with self._lock:
            self.used += len(data) - self._lru.pop(path, 0)
            self._lru[path] = len(data)
            self._evict()

    def forget(self, key: str) -> None:
        path = self.folder / key
        with self._lock:
            self.used -= self._lru.pop(path, 0)
        path.unlink(missing_ok=True)

    def _evict(self) -> None:
        while self.used > self.limit and self._lru:
            path, n = self._lru.popitem(last=False)
            self.used -= n
            path.unlink(missing_ok=True)


def default_cache() -> RangeCache:
    """The node's feature cache: `<DRAFTFLOW_CACHE>/features`, `DRAFTFLOW_FEATURE_CACHE_GB` large."""
    raw = os.environ.get(CACHE_ENV, str(DEFAULT_CACHE_GB))
    try:
        gb = float(raw)
    except ValueError:
        raise StoreError(f"{CACHE_ENV}={raw!r} is not a number; set it to the feature cache size in GB") from None
    return RangeCache(default_cache_dir() / "features", int(gb * 1e9))


class RangeReader:
    """`(start, end) -> bytes` of one remote shard: the cache, else one ranged GET (then cached)."""

    def __init__(self, fs, path: str, key: str, cache: RangeCache | None):
        self.fs, self.path, self.key, self.cache = fs, path, key, cache

    def cache_key(self, start: int, end: int) -> str:
        return f"{self.key}/{start}-{end}.bin"

    def __call__(self, start: int, end: int) -> bytes:
        key = self.cache_key(start, end)
        if self.cache is not None and (data := self.cache.get(key)) is not None:
            return data
        data = self.fs.cat_file(self.path, start=start, end=end)
        if len(data) != end - start:
            raise StoreError(
                f"feature shard {self.path}: asked bytes {start}-{end}, got {len(data)}; it is "
                "truncated, delete it and re-run extract"
            )
        if self.cache is not None:
            self.cache.put(key, data)
        return data

    def forget(self, ranges: list[tuple[int, int]]) -> None:
        if self.cache is not None:
            for start, end in ranges:
                self.cache.forget(self.cache_key(start, end))


class FeatureReader:
    """The samples of several feature shards, in shard order, read when taken.

    Args:
        shards: open shards (their indexes are read; no sample is).
        verify: per shard, whether each read is checked against the index's checksums.
        readers: threads reading samples, so several reads are in flight (a disk or S3 serves one
            12 MB read at a time at ~0.75x of its sequential speed, 2-4 at ~0.9x: see the README).

    Trade-off: `take` reads in the order asked (the trainer's shuffle), one sample at a time;
    each sample is a few large contiguous reads, which a disk serves near sequential speed and
    S3 as a few ranged GETs, while a whole-shard read would load what this rank never trains on.
    """

    def __init__(self, shards: Sequence[FeatureShard], verify: Sequence[bool] | None = None, readers: int = READERS):
        self.shards, self.readers = list(shards), readers
        self.verify = list(verify) if verify is not None else [False] * len(self.shards)
        self._where = [(k, i) for k, s in enumerate(self.shards) for i in range(len(s))]
        self.sample_ids = [sid for s in self.shards for sid in s.sample_ids]
        self.lengths = [int(n) for s in self.shards for n in (s.offsets[1:] - s.offsets[:-1]).tolist()]
        self.tokens = sum(self.lengths)
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: dict[int, Future] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __getitem__(self, i: int) -> FeatureSample:
        return self.take([i])[0]

    def take(self, indices: Sequence[int]) -> list[FeatureSample]:
        """The samples at global positions `indices` (shard order): prefetched ones, the rest read now
        (by the reader threads, several at a time)."""
        futures = [self._ahead.pop(i, None) or self._submit(i) for i in indices]
        self._ahead.clear()  # a prefetch the trainer did not take (another rank's resume plan) is dropped
        return [f.result() for f in futures]

    def prefetch(self, indices: Sequence[int]) -> None:
        """Start reading `indices` in the reader threads (the trainer's next step)."""
        for i in indices:
            if i not in self._ahead:
                self._ahead[i] = self._submit(i)

    def _submit(self, i: int) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.readers, thread_name_prefix="feature-reader")
        return self._pool.submit(self._read, *self._where[i])

    def _read(self, k: int, i: int) -> FeatureSample:
        shard = self.shards[k]
        if not self.verify[k]:
            return shard.get(i)
        try:
            return shard.get(i, verify=True)
        except StoreError:
            if not isinstance(shard.reader, RangeReader):
                raise
            shard.reader.forget(shard.ranges(i))  # a damaged cache entry: read from the store once more
            return shard.get(i, verify=True)


def open_shard(
    store: Store, stage: str, fingerprint: str, entry: ShardEntry, cache: RangeCache | None = None
) -> tuple[FeatureShard, bool]:
    """(the shard of manifest `entry`, whether its reads are verified one by one).

    The one decision on verification: a shard whose index has per-sample checksums (v3) is read
    in place (local) or by ranged GETs through `cache` (remote) and verified per read; an older
    one is verified whole by sha256 (remote: downloaded once to the local cache first).

    Raises:
        StoreError: the shard is unreadable, or (v2) fails its checksum.
    """
    path = store.stage_path(stage, fingerprint, entry.name)
    if store.is_local:
        shard = FeatureShard(path)
    else:
        reader = RangeReader(store.fs, path, entry.sha256[:32], cache)
        shard = FeatureShard(store.url(path), reader=reader, size=entry.bytes)
    if shard.sample_sha256 is not None:
        return shard, True
    return FeatureShard(store.verify_sha(stage, fingerprint, entry)), False


def open_features(
    store: Store, stage: str, fingerprint: str, entries: Sequence[ShardEntry], cache: RangeCache | None = None
) -> FeatureReader:
    """A source over the feature shards of manifest `entries` (remote roots: streamed, `default_cache()`)."""
    if cache is None and not store.is_local:
        cache = default_cache()
    opened = [open_shard(store, stage, fingerprint, e, cache) for e in entries]
    return FeatureReader([s for s, _ in opened], [v for _, v in opened])


def local_source(paths: Sequence[str]) -> FeatureReader:
    """A source over local shard files, read unverified (the caller verified them, or measures reads)."""
    return FeatureReader([FeatureShard(p) for p in paths])
