"""Feature shards: the target's hidden states at the drafter's taps.

One safetensors file holds many samples, packed along the token axis:

    hidden_states  (T_total, n_taps, D)  bf16, fp32 or fp8 (e4m3)   tap i = layer_ids[i]
    scales         (T_total, n_taps)     fp32, fp8 only            one scale per token and tap
    input_ids      (T_total,)            int32
    loss_mask      (T_total,)            uint8                     1 = supervised
    offsets        (n_samples + 1,)      int64                     sample j = [offsets[j], offsets[j+1])

Metadata (strings): `format`, `dtype`, `layer_ids` (JSON list, DFlash ids, see
`draftflow.layers`), `sample_ids` (JSON list, in offset order) and, from format v3,
`sample_sha256` (JSON list): per sample, the sha256 of its id and its stored rows of
every tensor but `offsets` (`sample_digest`), so a reader of one sample's byte ranges
can verify what it read without the whole file. Together: the per-shard index.
v2 shards (no `sample_sha256`) stay readable; they are verified whole. Bytes per
token are taps x hidden x dtype size plus 5 (ids, mask), plus 4 x taps for fp8
scales: within 1% of the raw features from hidden 1024 up.

The file is standard safetensors, but written and read here directly: writes
stream sample by sample (a shard never has to fit in memory twice, and shards
merge by copying byte ranges), and reads take byte ranges of one sample: one
`pread` per stored tensor (local) or ranged reads of an fsspec file (`s3://…`),
so random access by sample id never reads the whole shard. fp8 reads dequantize
to bf16. This module knows nothing of models, engines or stages.

Trade-off (local reads): one large `pread` per tensor range copies the sample
into process memory, where an mmap view would be zero-copy. On a cold page
cache the mmap faulted 4 KiB pages in behind a small read-ahead window and read
at ~0.46x raw disk (issue 16); a pread of a whole range is one request the
kernel serves at sequential speed (`benchmarks/feature_store.py`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import fsspec
import torch

from draftflow.errors import StoreError
from draftflow.store import sha256_file

FORMAT = "draftflow.features.v3"  # v3: per-sample checksums in the index
READABLE = ("draftflow.features.v2", FORMAT)
STORED = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float8": torch.float8_e4m3fn}
_ST_NAMES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3", torch.int32: "I32",
             torch.int64: "I64", torch.uint8: "U8"}
_ST_DTYPES = {v: k for k, v in _ST_NAMES.items()}
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_MIN_SCALE = 1e-12  # an all-zero row quantizes to zeros, never to NaN


@dataclass
class FeatureSample:
    sample_id: str
    input_ids: torch.Tensor  # (T,) int
    loss_mask: torch.Tensor  # (T,) bool
    hidden: torch.Tensor  # (T, n_taps, D)


# -- encoding ------------------------------------------------------------------------------------
def quantize_fp8(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, n, D) -> fp8 e4m3 values (T, n, D) and fp32 scales (T, n): x ~ q * scale."""
    h = hidden.float()
    scales = (h.abs().amax(dim=-1) / FP8_MAX).clamp(min=_MIN_SCALE)  # (T, n)
    return (h / scales[..., None]).to(torch.float8_e4m3fn), scales


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return (q.float() * scales[..., None]).to(dtype)


def encode(hidden: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """The stored tensors of (T, n, D) features: `hidden_states` (and `scales` for float8)."""
    if dtype == "float8":
        q, scales = quantize_fp8(hidden)
        return {"hidden_states": q, "scales": scales}
    return {"hidden_states": hidden.to(STORED[dtype])}


def round_trip(feats: torch.Tensor, dtype: str, n_taps: int) -> torch.Tensor:
    """`feats` (T, n_taps * D) or (T, n_taps, D) as a reader of a `dtype` shard would get them,
    in the input's dtype and shape: what the drafter sees in training, reproduced at inference."""
    shape = feats.shape
    hidden = feats.reshape(shape[0], n_taps, -1)
    enc = encode(hidden, dtype)
    out = dequantize_fp8(enc["hidden_states"], enc["scales"]) if dtype == "float8" else enc["hidden_states"]
    return out.to(feats.dtype).reshape(shape)


# -- writing -------------------------------------------------------------------------------------
def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())


def _header(specs: list, meta: dict[str, str]) -> tuple[dict, bytes]:
    header: dict = {"__metadata__": meta}
    off = 0
    for name, dtype, shape, _ in specs:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _ST_NAMES[dtype], "shape": shape, "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return header, struct.pack("<Q", len(raw)) + raw


def _write(path: str | Path, specs: list[tuple[str, torch.dtype, list[int], Iterable[torch.Tensor]]],
           meta: dict[str, str], final_meta: Future | None = None) -> None:
    """Write a safetensors file tensor by tensor, each from an iterable of row blocks.

    With `final_meta` (metadata still being computed, e.g. checksums hashed in another thread),
    `meta` is a placeholder of the same encoded length: the data is written meanwhile, then the
    header again with the final metadata.
    """
    header, raw = _header(specs, meta)
    with open(path, "wb") as fh:
        fh.write(raw)
        for name, _, _, parts in specs:
            start = fh.tell()
            for part in parts:
                fh.write(_bytes(part))
            lo, hi = header[name]["data_offsets"]
            assert fh.tell() - start == hi - lo, f"{name}: wrote {fh.tell() - start} bytes, header says {hi - lo}"
        if final_meta is not None:
            _, final = _header(specs, final_meta.result())
            assert len(final) == len(raw), "the final metadata must encode to the placeholder's length"
            fh.seek(0)
            fh.write(final)


def _offsets(lengths: list[int]) -> torch.Tensor:
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return offsets


def _meta(layer_ids: list[int], dtype: str, sample_ids: list[str], digests: list[str]) -> dict[str, str]:
    return {"format": FORMAT, "dtype": dtype, "layer_ids": json.dumps(list(layer_ids)),
            "sample_ids": json.dumps(sample_ids), "sample_sha256": json.dumps(digests)}


def sample_digest(sample_id: str, rows: Iterable[torch.Tensor]) -> str:
    """sha256 of a sample's id and its stored rows, tensor by tensor in file order (`offsets` excluded)."""
    h = hashlib.sha256(sample_id.encode() + b"\0")
    for t in rows:
        h.update(_bytes(t))
    return h.hexdigest()


def write_feature_shard(path: str | Path, samples: list[FeatureSample], layer_ids: list[int],
                        dtype: str = "bfloat16") -> int:
    """Pack samples into one feature shard at `path` (a local path); return tokens written."""
    if not samples:
        raise ValueError("a feature shard needs at least one sample")
    enc = [encode(s.hidden, dtype) for s in samples]
    offsets = _offsets([int(s.input_ids.numel()) for s in samples])
    T, (n, D) = int(offsets[-1]), enc[0]["hidden_states"].shape[1:]
    specs = [("hidden_states", STORED[dtype], [T, n, D], (e["hidden_states"] for e in enc))]
    if dtype == "float8":
        specs.append(("scales", torch.float32, [T, n], (e["scales"] for e in enc)))
    specs += [("input_ids", torch.int32, [T], (s.input_ids.to(torch.int32) for s in samples)),
              ("loss_mask", torch.uint8, [T], (s.loss_mask.to(torch.uint8) for s in samples)),
              ("offsets", torch.int64, [len(samples) + 1], [offsets])]
    ids = [s.sample_id for s in samples]

    def digests() -> dict[str, str]:  # e: hidden_states (then scales): file order
        return _meta(layer_ids, dtype, ids, [
            sample_digest(s.sample_id, [*e.values(), s.input_ids.to(torch.int32), s.loss_mask.to(torch.uint8)])
            for s, e in zip(samples, enc, strict=True)])

    # Hashing runs beside the writes (hashlib and file writes release the GIL); a hex digest has a
    # fixed length, so the header is written first with zeros and again once the digests are known.
    with ThreadPoolExecutor(1, thread_name_prefix="feature-digests") as pool:
        _write(path, specs, _meta(layer_ids, dtype, ids, ["0" * 64] * len(ids)), pool.submit(digests))
    return T


def merge_feature_shards(path: str | Path, parts: list[FeatureShard], sample_ids: list[str]) -> int:
    """Write the samples `sample_ids`, found in `parts`, as one shard in that order; return tokens.

    Stored bytes are copied as they are (no re-encoding): a merged fp8 shard equals one written at once.
    """
    where = {sid: (p, i) for p in parts for i, sid in enumerate(p.sample_ids)}
    missing = [sid for sid in sample_ids if sid not in where]
    if missing:
        raise StoreError(f"cannot merge feature parts: {len(missing)} samples missing (e.g. {missing[0]})")
    first = parts[0]
    if any(p.layer_ids != first.layer_ids or p.dtype != first.dtype for p in parts):
        raise StoreError("cannot merge feature parts with different layer ids or dtypes")
    picks = [where[sid] for sid in sample_ids]
    offsets = _offsets([p.length(i) for p, i in picks])
    T = int(offsets[-1])
    def rows_of(name: str) -> Iterator[torch.Tensor]:
        return (p.rows(name, i) for p, i in picks)

    specs = []
    for name in first.tensor_names():
        if name != "offsets":
            dtype, shape = first.tensor_info(name)
            specs.append((name, dtype, [T, *shape[1:]], rows_of(name)))
    specs.append(("offsets", torch.int64, [len(picks) + 1], [offsets]))
    _write(path, specs, _meta(first.layer_ids, first.dtype, list(sample_ids), [p.digest(i) for p, i in picks]))
    return T


# -- reading -------------------------------------------------------------------------------------
def read_range(path: str, start: int, end: int) -> bytearray:
    """Bytes [start, end) of a local file in one `pread` (repeated only after a short read)."""
    buf = bytearray(end - start)
    view, fd = memoryview(buf), os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(buf):
            n = os.preadv(fd, [view[done:]], start + done)
            if n <= 0:
                raise StoreError(f"feature shard {path} ended at byte {start + done}; it will be recomputed")
            done += n
    finally:
        os.close(fd)
    return buf


def sha256_of(path: str, storage_options: dict | None = None, fs=None) -> str:
    """sha256 of a local or fsspec file (a path on `fs` when given), streamed."""
    if fs is None:
        fs, path = fsspec.core.url_to_fs(str(path), **(storage_options or {}))
    return sha256_file(path, fs)


class FeatureShard:
    """Random access by sample id, and streaming, over one feature shard (local path or fsspec URL).

    Local files are read with one `pread` per tensor range (tensors own their memory); remote
    ones by byte range through fsspec, or through `reader` when given: a callable
    `(start, end) -> bytes` (ranged GETs of a streaming source, `draftflow.feature_stream`).
    With `sha256`, the whole file is hashed first. A truncated, foreign or corrupted file raises
    `StoreError`.
    """

    def __init__(self, path: str | Path, sha256: str | None = None, storage_options: dict | None = None,
                 reader=None, size: int | None = None):
        self.path = str(path)
        if sha256 is not None and sha256_of(self.path, storage_options) != sha256:
            raise StoreError(f"feature shard {self.path} fails its checksum; it will be recomputed")
        if reader is not None:
            self._remote, self.reader, self._size = True, reader, size
        else:
            self.reader = None
            self._open(storage_options or {})
        self._read_header()
        self.offsets = self._tensor("offsets", 0, self._info["offsets"]["shape"][0])
        self._index = {sid: i for i, sid in enumerate(self.sample_ids)}

    def _open(self, storage_options: dict) -> None:
        fs, p = fsspec.core.url_to_fs(self.path, **storage_options)
        self._remote = "local" not in fs.protocol and "file" not in fs.protocol
        self._size = fs.size(p)
        if self._remote:
            self._fh = fs.open(p, "rb", block_size=4 << 20)
        else:
            self._local = p

    def _bytes(self, start: int, end: int):
        if end > self._size:
            raise StoreError(f"feature shard {self.path} is truncated; it will be recomputed")
        if not self._remote:
            return read_range(self._local, start, end)
        if self.reader is not None:
            return bytearray(self.reader(start, end))
        self._fh.seek(start)
        return bytearray(self._fh.read(end - start))

    def _read_header(self) -> None:
        try:
            (n,) = struct.unpack("<Q", bytes(self._bytes(0, 8)))
            header = json.loads(bytes(self._bytes(8, 8 + n)))
        except (struct.error, ValueError, StoreError) as exc:
            raise StoreError(f"feature shard {self.path} is unreadable ({exc}); it will be recomputed") from None
        meta = header.pop("__metadata__", {}) or {}
        if meta.get("format") not in READABLE:
            raise StoreError(f"feature shard {self.path} has format {meta.get('format')!r}, expected {FORMAT}")
        self._start, self._info = 8 + n, header
        end = self._start + max(v["data_offsets"][1] for v in header.values())
        if end != self._size:
            raise StoreError(f"feature shard {self.path} has {self._size} bytes, its header says {end}; "
                             "it is truncated or corrupted and will be recomputed")
        self.dtype: str = meta["dtype"]
        self.layer_ids: list[int] = json.loads(meta["layer_ids"])
        self.sample_ids: list[str] = json.loads(meta["sample_ids"])
        self.sample_sha256: list[str] | None = json.loads(meta["sample_sha256"]) if "sample_sha256" in meta else None

    def tensor_names(self) -> list[str]:
        return sorted(self._info, key=lambda k: self._info[k]["data_offsets"][0])

    def tensor_info(self, name: str) -> tuple[torch.dtype, list[int]]:
        return _ST_DTYPES[self._info[name]["dtype"]], self._info[name]["shape"]

    def _span(self, name: str, lo: int, hi: int) -> tuple[int, int]:
        """File bytes of rows [lo, hi) of a stored tensor."""
        dtype, shape = self.tensor_info(name)
        row = math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size()
        start = self._start + self._info[name]["data_offsets"][0]
        return start + lo * row, start + hi * row

    def ranges(self, key: int | str) -> list[tuple[int, int]]:
        """File byte ranges of one sample's rows, tensor by tensor in file order (`offsets` excluded)."""
        i = self._pos(key)
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return [self._span(name, lo, hi) for name in self.tensor_names() if name != "offsets"]

    def _tensor(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of a stored tensor, as stored (in memory the tensor owns)."""
        dtype, shape = self.tensor_info(name)
        if hi <= lo:
            return torch.empty((0, *shape[1:]), dtype=dtype)
        buf = self._bytes(*self._span(name, lo, hi))
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(hi - lo, *shape[1:])

    def __len__(self) -> int:
        return len(self.sample_ids)

    def _pos(self, key: int | str) -> int:
        if isinstance(key, str):
            if key not in self._index:
                raise KeyError(f"sample {key!r} is not in feature shard {self.path}")
            return self._index[key]
        return key

    def length(self, key: int | str) -> int:
        i = self._pos(key)
        return int(self.offsets[i + 1] - self.offsets[i])

    def rows(self, name: str, key: int | str) -> torch.Tensor:
        """One sample's rows of one stored tensor, as stored (fp8 stays fp8)."""
        i = self._pos(key)
        return self._tensor(name, int(self.offsets[i]), int(self.offsets[i + 1]))

    def _stored(self, i: int) -> dict[str, torch.Tensor]:
        return {name: self.rows(name, i) for name in self.tensor_names() if name != "offsets"}

    def digest(self, key: int | str) -> str:
        """The sample's checksum: from the index (v3), else computed from its rows (v2)."""
        i = self._pos(key)
        if self.sample_sha256 is not None:
            return self.sample_sha256[i]
        return sample_digest(self.sample_ids[i], self._stored(i).values())

    def get(self, key: int | str, verify: bool = False) -> FeatureSample:
        """One sample by position or by sample id; fp8 features come back dequantized to bf16.

        With `verify`, the rows read are checked against the index's checksum (v3 shards).

        Raises:
            StoreError: `verify` on a shard without checksums, or the rows fail theirs.
        """
        i = self._pos(key)
        rows = self._stored(i)
        if verify:
            if self.sample_sha256 is None:
                raise StoreError(f"feature shard {self.path} has no per-sample checksums; verify it whole")
            if sample_digest(self.sample_ids[i], rows.values()) != self.sample_sha256[i]:
                raise StoreError(f"sample {self.sample_ids[i]!r} of feature shard {self.path} fails its checksum; "
                                 "delete the shard and re-run extract")
        hidden = rows["hidden_states"]
        if self.dtype == "float8":
            hidden = dequantize_fp8(hidden, rows["scales"])
        return FeatureSample(self.sample_ids[i], rows["input_ids"].to(torch.int64), rows["loss_mask"].bool(), hidden)

    def __iter__(self) -> Iterator[FeatureSample]:
        """Every sample in stored order (sequential reads: remote shards stream by read-ahead)."""
        for i in range(len(self)):
            yield self.get(i)


def load_samples(paths: list[str | Path]) -> list[FeatureSample]:
    """Every sample of the given shards (local paths or fsspec URLs), in order."""
    return [s for p in paths for s in FeatureShard(p)]
