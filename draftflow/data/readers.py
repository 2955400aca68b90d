"""Streaming source readers: files (local or s3://, by fsspec) and Hugging Face datasets.

A source is a path (a file or a glob; relative to an installed Python package's folder when the
source names a `package`), a Hugging Face dataset name, or a self_instruct or code_stubs source's
generated file (`SourceConfig.generated`, set at stage start). Files are
JSONL (`.jsonl`/`.json`, plain or compressed: `.gz`, `.zst`, `.bz2`, `.xz`,
inferred from the extension; a file whose text starts with `[` is one JSON array of objects, streamed
by `draftflow.data.json_array`) or parquet (read in row batches). Hugging Face
datasets are read with `datasets`' streaming loader, imported lazily (the
optional extra `draftflow[hf]`). Nothing here holds more than one batch of a
source in memory; lines that cannot be parsed come out as `BadRow`s to count,
never as exceptions; a file that cannot be read at all (another format, truncated,
corrupt, refused by storage) is a `SourceError` naming it. `sniff_file` checks a file's
format from its first bytes (parquet: its magic and footer) so preflight stops a bad
file before any work without reading it whole. This module knows nothing about row shapes
(see sources.py).
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import fsspec

from draftflow.config import SourceConfig
from draftflow.data.json_array import read_array
from draftflow.data.sources import BadRow
from draftflow.errors import ConfigError, SourceError
from draftflow.store import USER_CAUSES, storage_cause, storage_error_message

PARQUET_BATCH = 1024
SNIFF_BYTES = 64 << 10
PARQUET_MAGIC = b"PAR1"


def _hf():
    try:
        import datasets
    except ImportError:
        raise SourceError("reading hf: sources needs the datasets package; pip install 'draftflow[hf]'") from None
    return datasets


def _open_hf(src: SourceConfig):
    """A streaming `IterableDataset` for an `hf:` source (a hub name or a local data folder)."""
    return _hf().load_dataset(src.hf, src.hf_config, split=src.hf_split, streaming=True)


def import_folder(package: str) -> str | None:
    """The folder of an installed package (import name), found without importing it; None when it is not
    installed or is a single module."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):  # a dotted name whose parent is missing
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    return folders[0] if folders else None


def package_folder(src: SourceConfig) -> str:
    """The folder of the installed package a source reads from (`SourceConfig.package`).

    Raises:
        ConfigError: the package is not installed (the message gives the pip command).
    """
    folder = import_folder(src.package)
    if folder is None:
        hint = src.pip or src.package.replace("_", "-")
        raise ConfigError(f"source '{src.name}' reads from the Python package {src.package}, which is not "
                          f"installed: pip install {hint}")
    return folder


def source_path(src: SourceConfig) -> str:
    """The file or glob a file source reads: `path`, resolved inside its `package`, or the generated
    file of a self_instruct or code_stubs source.

    Raises:
        ConfigError: the package is not installed, or a generated source is not generated yet.
    """
    if src.generator is not None:
        if src.generated is None:
            raise ConfigError(f"source '{src.name}': its {src.generator} prompts are not generated yet "
                              "(draftflow.stages.curate.materialize_sources runs first)")
        return src.generated
    if src.package is not None:
        return os.path.join(package_folder(src), src.path)
    return src.path


def source_files(src: SourceConfig) -> list[str]:
    """The files of a file source (a glob expands, sorted), as URLs; [] for hf sources.

    Raises:
        SourceError: the path cannot be reached or matches no file.
        ConfigError: see `source_path`.
    """
    if src.hf is not None:
        return []
    where = source_path(src)
    try:
        fs, path = fsspec.core.url_to_fs(where)
        found = sorted(fs.glob(path)) if fsspec.core.has_magic(path) else ([path] if fs.exists(path) else [])
        found = [f for f in found if not fs.isdir(f)]
    except Exception as exc:  # a bad URL, missing credentials, unknown protocol
        raise SourceError(f"source '{src.name}': {storage_error_message(exc, where)}") from None
    if not found and not fsspec.core.has_magic(path) and fs.isdir(path):
        raise SourceError(f"source '{src.name}': path {where} is a folder; give a file or a glob such as "
                          f"{where.rstrip('/')}/*.jsonl in curate.sources[].path")
    if not found:
        raise SourceError(f"source '{src.name}': path {where} does not exist; fix curate.sources[].path")
    return [fs.unstrip_protocol(f) for f in found] if "://" in where else found


def check_source(src: SourceConfig) -> None:
    """Fail at stage start, before any work, when a source cannot be reached or a file of it
    is not in its format (sniffed from its first bytes; many files are sniffed in parallel). A self_instruct
    or code_stubs source is checked once its prompts are generated (nothing to reach before)."""
    if src.generator is not None and src.generated is None:
        return
    if src.hf is None:
        files = source_files(src)
        try:
            if len(files) == 1:
                sniff_file(files[0])
                return
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(min(16, len(files))) as pool:
                list(pool.map(sniff_file, files))
        except SourceError as exc:
            raise SourceError(f"source '{src.name}': {exc}") from None
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


MAX_ROW_BYTES = 16 << 20  # curate.sources[].max_row_bytes' default
REJECT_HEAD_BYTES = 4096  # what the rejects shard keeps of a row too large to read


def source_key(src: SourceConfig) -> str:
    """What identifies a source's content: its files' keys, the hf name/config/split, or a generated
    source's file name (a key of all that decides its content, or its content's digest): a cache wiped or
    moved, or another machine, writes the same prompts under the same key."""
    if src.hf is not None:
        return json.dumps(["hf", src.hf, src.hf_config, src.hf_split])
    if src.generator is not None:
        return json.dumps([src.generator, os.path.basename(source_path(src))])
    files = source_files(src)
    return json.dumps(list(zip(files, file_keys(files))))


def read_file(path: str, max_row_bytes: int = MAX_ROW_BYTES) -> Iterator[dict[str, Any] | BadRow]:
    """Raw rows of one file: parquet by extension, JSONL otherwise (a line over `max_row_bytes`: a
    `row_too_large` BadRow holding its first REJECT_HEAD_BYTES, the rest skipped unread into memory).

    Raises:
        SourceError: naming the file, when it is not in its format, truncated, or storage refuses it
            for a cause a retry cannot fix. Other errors (a dropped connection) pass unchanged.
    """
    with naming_the_file(path):
        if path.endswith(".parquet"):
            yield from _read_parquet(path)
        else:
            yield from _read_jsonl(path, max_row_bytes)


def _format_errors() -> tuple[type[BaseException], ...]:
    """What reading a file in the wrong format raises: decompressors' and pyarrow's errors."""
    import gzip
    import lzma
    import zlib

    import pyarrow as pa

    errors: list[type[BaseException]] = [EOFError, gzip.BadGzipFile, lzma.LZMAError, zlib.error,
                                         UnicodeDecodeError, pa.ArrowException]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:
        pass
    return tuple(errors)


def read_error(path: str, exc: BaseException) -> BaseException:
    """The `SourceError` naming `path` for a failed read; `exc` itself when a retry may fix it."""
    if isinstance(exc, _format_errors()):
        kind = "parquet" if path.endswith(".parquet") else "JSON Lines"
        detail = " ".join(str(exc).split()) or type(exc).__name__
        return SourceError(f"cannot read {path} as {kind} ({type(exc).__name__}: {detail}); the file is "
                           "truncated, corrupt or in another format: fix or remove it, or fix curate.sources[].path")
    if storage_cause(exc) in USER_CAUSES | {"not_found"}:
        return SourceError(storage_error_message(exc, path))
    return exc


@contextmanager
def naming_the_file(path: str) -> Iterator[None]:
    """Turn an error reading `path` into a `SourceError` naming it when `read_error` says the user must
    fix it (a wrong format, a refused read); other errors, e.g. a dropped connection, pass unchanged."""
    try:
        yield
    except SourceError:
        raise
    except Exception as exc:
        error = read_error(path, exc)
        if error is exc:
            raise
        raise error from None


def sniff_file(path: str) -> None:
    """Check that a source file is in the format its name says, from its first bytes only.

    Parquet: the magic at both ends and a readable footer. JSON Lines (plain or compressed):
    the first 64 KiB decompress, are UTF-8 text, and start with a JSON object.

    Raises:
        SourceError: naming the file and what is wrong with it.
    """
    with naming_the_file(path):
        (_sniff_parquet if path.endswith(".parquet") else _sniff_jsonl)(path)


def _sniff_parquet(path: str) -> None:
    import pyarrow.parquet as pq

    with fsspec.open(path, "rb") as fh:
        head = fh.read(4)
        size = fh.seek(0, 2)
        tail = b""
        if size >= 12:
            fh.seek(size - 4)
            tail = fh.read(4)
        if head != PARQUET_MAGIC or tail != PARQUET_MAGIC:
            raise SourceError(f"{path} is not a parquet file ({size} bytes, no {PARQUET_MAGIC!r} magic at its "
                              f"{'start' if head != PARQUET_MAGIC else 'end'}: truncated, or another format); "
                              "fix or remove it, or fix curate.sources[].path")
        fh.seek(0)
        pq.ParquetFile(fh)  # parses the footer (schema, row groups): no row data is read


def _sniff_jsonl(path: str) -> None:
    with _open_lines(path) as fh:
        head = fh.read(SNIFF_BYTES)
    if b"\x00" in head:
        raise SourceError(f"{path} is binary, not JSON Lines text (compressed files need a .gz, .zst, .bz2 or "
                          ".xz name; parquet a .parquet name); fix or remove it, or fix curate.sources[].path")
    text = head.decode("utf-8", "replace").lstrip("\ufeff \t\r\n")
    array = text.startswith("[")
    if array and not text[1:].lstrip().startswith(("{", "]")):
        raise SourceError(f"{path} is a JSON array of {text[1:].lstrip()[:20]!r}..., not of objects: draftflow reads "
                          "JSON Lines or an array of objects; convert it, or fix curate.sources[].path")
    if text and not array and not text.startswith("{"):
        raise SourceError(f"{path} starts with {text[:20]!r}, not a JSON object: draftflow reads JSON Lines (one "
                          "object per line) or a JSON array of objects; convert it, or fix curate.sources[].path")


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


def _read_jsonl(path: str, max_row_bytes: int = MAX_ROW_BYTES) -> Iterator[dict[str, Any] | BadRow]:
    """JSON Lines, or one JSON array of objects (`draftflow.data.json_array`: ShareGPT's files) when the text
    starts with `[`."""
    with _open_lines(path) as fh:
        if _starts_array(fh):
            yield from read_array(fh, max_row_bytes, REJECT_HEAD_BYTES)
            return
        for lineno, (raw, size) in enumerate(_bounded_lines(fh, max_row_bytes), 1):
            if size > max_row_bytes:
                yield BadRow("row_too_large", f"line {lineno}: {size:,} bytes, over max_row_bytes "
                             f"({max_row_bytes:,})", raw.decode("utf-8", "replace") + "...")
            elif raw.strip():
                yield _parse_line(raw, lineno)


def _starts_array(fh) -> bool:
    """Whether the text starts (after whitespace) with `[`; `fh` is left at its start (a peek, not a read)."""
    head = fh.peek(SNIFF_BYTES)[:SNIFF_BYTES] if hasattr(fh, "peek") else b""
    if not head:
        start = fh.tell()
        head = fh.read(4096)
        fh.seek(start)
    return head.lstrip(b"\xef\xbb\xbf \t\r\n")[:1] == b"["


def _bounded_lines(fh, limit: int, chunk: int = 1 << 20) -> Iterator[tuple[bytes, int]]:
    """(line, its size) per line of a binary file, reading `chunk` bytes at a time: a line over `limit`
    bytes comes as its first REJECT_HEAD_BYTES and its full size, the rest read past, never held."""
    buf, over, head = b"", 0, b""  # over > 0: inside a line already past the limit (bytes seen so far)
    while data := fh.read(chunk):
        buf, pos = buf + data, 0
        while (end := buf.find(b"\n", pos)) >= 0:
            line, pos = buf[pos:end + 1], end + 1
            if over:
                yield head, over + len(line)
                over, head = 0, b""
            else:
                yield line, len(line)
        buf = buf[pos:]
        if len(buf) > limit or over:  # no newline yet in a line over the bound: drop what is held
            head = head or buf[:REJECT_HEAD_BYTES]
            over, buf = over + len(buf), b""
    if over:
        yield head, over + len(buf)
    elif buf:
        yield buf, len(buf)


def _parse_line(raw: bytes, lineno: int) -> dict[str, Any] | BadRow:
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return BadRow("invalid_utf8", f"line {lineno}", raw.decode("utf-8", "replace"))
    except json.JSONDecodeError as exc:
        return BadRow("malformed_json", f"line {lineno}: {exc.msg}", raw.decode("utf-8", "replace"))
    except ValueError as exc:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        return BadRow("number_too_large", f"line {lineno}: {exc}", raw[:REJECT_HEAD_BYTES].decode("utf-8", "replace"))
    except RecursionError:
        return BadRow("too_deeply_nested", f"line {lineno}", raw[:REJECT_HEAD_BYTES].decode("utf-8", "replace"))
    return row if isinstance(row, dict) else BadRow("not_an_object", f"line {lineno}", raw.decode())


def _read_parquet(path: str) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    with fsspec.open(path, "rb") as fh:
        for batch in pq.ParquetFile(fh).iter_batches(batch_size=PARQUET_BATCH):
            yield from batch.to_pylist()
