"""Streaming source readers: files (local or s3://, by fsspec) and Hugging Face datasets.

A source is a path (a file or a glob) or a Hugging Face dataset name. Files are
JSONL (`.jsonl`/`.json`, plain or compressed: `.gz`, `.zst`, `.bz2`, `.xz`,
inferred from the extension) or parquet (read in row batches). Hugging Face
datasets are read with `datasets`' streaming loader, imported lazily (the
optional extra `draftflow[hf]`). Nothing here holds more than one batch of a
source in memory; lines that cannot be parsed come out as `BadRow`s to count,
never as exceptions. This module knows nothing about row shapes (see sources.py).
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import fsspec

from draftflow.config import SourceConfig
from draftflow.data.sources import BadRow
from draftflow.errors import SourceError

PARQUET_BATCH = 1024


def _hf():
    try:
        import datasets
    except ImportError:
        raise SourceError("reading hf: sources needs the datasets package; pip install 'draftflow[hf]'") from None
    return datasets


def _open_hf(src: SourceConfig):
    """A streaming `IterableDataset` for an `hf:` source (a hub name or a local data folder)."""
    return _hf().load_dataset(src.hf, src.hf_config, split=src.hf_split, streaming=True)


def source_files(src: SourceConfig) -> list[str]:
    """The files of a path source (a glob expands, sorted), as URLs; [] for hf sources.

    Raises:
        SourceError: the path cannot be reached or matches no file.
    """
    if src.hf is not None:
        return []
    try:
        fs, path = fsspec.core.url_to_fs(src.path)
        found = sorted(fs.glob(path)) if fsspec.core.has_magic(path) else ([path] if fs.exists(path) else [])
        found = [f for f in found if not fs.isdir(f)]
    except Exception as exc:  # a bad URL, missing credentials, unknown protocol
        raise SourceError(f"source '{src.name}': cannot reach {src.path} ({exc})") from None
    if not found:
        raise SourceError(f"source '{src.name}': path {src.path} does not exist; fix curate.sources[].path")
    return [fs.unstrip_protocol(f) for f in found] if "://" in src.path else found


def check_source(src: SourceConfig) -> None:
    """Fail at stage start, before any work, when a source cannot be reached."""
    if src.hf is None:
        source_files(src)
        return
    try:
        _open_hf(src)
    except SourceError:
        raise
    except Exception as exc:
        raise SourceError(f"source '{src.name}': cannot open hf dataset {src.hf!r} "
                          f"(config {src.hf_config}, split {src.hf_split}): {exc}".splitlines()[0]) from None


def file_keys(files: list[str]) -> list[str]:
    """A content key per file (fsspec `ukey`: size+mtime locally, ETag on S3)."""
    keys = []
    for f in files:
        fs, path = fsspec.core.url_to_fs(f)
        keys.append(str(fs.ukey(path)))
    return keys


def source_key(src: SourceConfig) -> str:
    """What identifies a source's content: its files' keys, or the hf name/config/split."""
    if src.hf is not None:
        return json.dumps(["hf", src.hf, src.hf_config, src.hf_split])
    files = source_files(src)
    return json.dumps(list(zip(files, file_keys(files))))


def read_file(path: str) -> Iterator[dict[str, Any] | BadRow]:
    """Raw rows of one file: parquet by extension, JSONL otherwise."""
    if path.endswith(".parquet"):
        yield from _read_parquet(path)
    else:
        yield from _read_jsonl(path)


def read_hf(src: SourceConfig) -> Iterator[dict[str, Any] | BadRow]:
    """Raw rows of an hf source, streamed."""
    yield from _open_hf(src)


@contextmanager
def _open_lines(path: str) -> Iterator[IO[bytes]]:
    """A binary file object that iterates lines, decompressing by extension."""
    if not path.endswith(".zst"):
        with fsspec.open(path, "rb", compression="infer") as fh:
            yield fh
        return
    import zstandard

    # fsspec's zstd reader stops after the first frame; multi-frame files (pzstd, appends) are common.
    with fsspec.open(path, "rb") as raw:
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        with io.BufferedReader(reader, buffer_size=1 << 20) as fh:
            yield fh


def _read_jsonl(path: str) -> Iterator[dict[str, Any] | BadRow]:
    with _open_lines(path) as fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            yield _parse_line(raw, lineno)


def _parse_line(raw: bytes, lineno: int) -> dict[str, Any] | BadRow:
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return BadRow("invalid_utf8", f"line {lineno}", raw.decode("utf-8", "replace"))
    except json.JSONDecodeError as exc:
        return BadRow("malformed_json", f"line {lineno}: {exc.msg}", raw.decode("utf-8", "replace"))
    return row if isinstance(row, dict) else BadRow("not_an_object", f"line {lineno}", raw.decode())


def _read_parquet(path: str) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    with fsspec.open(path, "rb") as fh:
        for batch in pq.ParquetFile(fh).iter_batches(batch_size=PARQUET_BATCH):
            yield from batch.to_pylist()
