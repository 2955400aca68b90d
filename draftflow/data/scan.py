"""Scan one part of a source: read, convert, filter, key, and write a partial shard.

A part is one or more files of one source (or one Hugging Face dataset). Its
rows are streamed through the adapter and the filters; survivors are written
in row batches to a partial parquet file with the digests the merge needs
(exact-dup key, shuffle key, prompt length, MinHash signature) and rejects go
to their own file with a reason. Memory holds one batch, whatever the part's
size. The merge (stages/curate.py) decides duplicates, mixture and split.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from draftflow.config import CurateConfig, SourceConfig
from draftflow.data import dedup
from draftflow.data.filters import (
    Prompt,
    apply_filters,
    build_filters,
    check_conversation,
    load_tokenizer,
    needs_tokens,
    prompt_text,
)
from draftflow.data.readers import read_file, read_hf
from draftflow.data.schema import CURATED, REJECTED, sample_id, to_stored
from draftflow.data.sources import BadRow, to_conversation
from draftflow.errors import ConfigError

BATCH = 4096
PREVIEW_CHARS = 160
PART = pa.schema(list(CURATED) + [
    pa.field("prompt_key", pa.uint64()), pa.field("order_key", pa.uint64()), pa.field("prompt_chars", pa.int32()),
    pa.field("prompt_tokens", pa.int32()), pa.field("minhash", pa.binary(dedup.NUM_PERM * 4)),
    pa.field("preview", pa.string()),
])


class _Writer:
    """Rows to a local parquet file in batches; the file exists only once a row was written."""

    def __init__(self, path: str, schema: pa.Schema):
        self.path, self.schema, self.buf, self.rows, self.writer = path, schema, [], 0, None

    def add(self, row: dict[str, Any]) -> None:
        self.buf.append(row)
        self.rows += 1
        if len(self.buf) >= BATCH:
            self.flush()

    def flush(self) -> None:
        if not self.buf:
            return
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.path, self.schema, compression="zstd")
        self.writer.write_table(pa.Table.from_pylist(self.buf, schema=self.schema))
        self.buf = []

    def close(self) -> None:
        self.flush()
        if self.writer is not None:
            self.writer.close()


class Scanner:
    """Converts and filters the rows of one source (the per-row work of a part)."""

    def __init__(self, cfg: CurateConfig, src: SourceConfig, tokenizer: str | None):
        if needs_tokens(cfg) and not tokenizer:
            raise ConfigError("curate.min/max_prompt_tokens need a tokenizer: set curate.tokenizer")
        self.cfg, self.src = cfg, src
        self.filters = build_filters(cfg)
        self.tokenizer = load_tokenizer(tokenizer) if needs_tokens(cfg) else None

    def row(self, raw: dict[str, Any] | BadRow) -> dict[str, Any]:
        """The partial row of one raw row; raises `BadRow` to reject it."""
        if isinstance(raw, BadRow):
            raise raw
        messages, tools = to_conversation(raw, self.src.format, self.src.columns)
        check_conversation(messages)
        text = prompt_text(messages)
        prompt = Prompt(text, self.tokenizer)
        apply_filters(self.filters, prompt)
        sid = sample_id(self.src.name, messages)  # the category is no part of the id: ids stay stable
        near = dedup.needs_signatures(self.cfg)  # near-dup or decontamination
        return {
            "sample_id": sid, "source": self.src.name, "split": None, "messages": to_stored(messages),
            "tools": tools, "category": row_category(self.src, raw),
            "prompt_key": dedup.prompt_key(messages), "order_key": dedup.order_key(self.cfg.seed, sid),
            "prompt_chars": len(text), "prompt_tokens": prompt.tokens, "preview": text[:PREVIEW_CHARS],
            "minhash": dedup.signature(text, self.cfg.near_dup_ngram) if near else None,
        }


def row_category(src: SourceConfig, raw: dict[str, Any]) -> str | None:
    """The row's evaluation category: its `src.category_field` column when set and non-empty, else
    `src.category` (None: reports use the source's name). Raises `BadRow('bad_category')` for a
    category column holding something other than a string or a number."""
    value = raw.get(src.category_field) if src.category_field else None
    if value is None or value == "":
        return src.category
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise BadRow("bad_category", f"column {src.category_field!r} holds a {type(value).__name__}, not a name")
    return str(value)


def part_rows(src: SourceConfig, files: list[str]) -> Iterator[dict[str, Any] | BadRow]:
    """The raw rows of a part, in file order."""
    if src.hf is not None:
        yield from read_hf(src)
    for f in files:
        yield from read_file(f, src.max_row_bytes)


def _reject(source: str, bad: BadRow, raw: Any) -> dict[str, str]:
    import json

    row = bad.row if bad.row is not None else raw
    text = row if isinstance(row, str) else json.dumps(row, ensure_ascii=False, default=str)
    clean = lambda s: s.encode("utf-8", "replace").decode("utf-8")  # lone surrogates cannot be stored
    return {"source": source, "reason": bad.reason, "detail": clean(bad.detail[:500]), "row": clean(text[:20000])}


def scan_to(out_path: str, rejects_path: str, cfg: CurateConfig, src: SourceConfig, files: list[str],
            tokenizer: str | None = None) -> dict[str, Any]:
    """Scan a part into local files; return its counts (`rows_in = rows_out + sum(dropped)`)."""
    scanner = Scanner(cfg, src, tokenizer)
    out, rej = _Writer(out_path, PART), _Writer(rejects_path, REJECTED)
    dropped: Counter = Counter()
    rows_in = 0
    for raw in part_rows(src, files):
        rows_in += 1
        try:
            out.add(scanner.row(raw))
        except BadRow as bad:
            dropped[bad.reason] += 1
            rej.add(_reject(src.name, bad, raw))
    out.close()
    rej.close()
    if out.writer is None:  # an empty partial still needs its schema for the merge
        pq.write_table(PART.empty_table(), out_path, compression="zstd")
    return {"rows_in": rows_in, "rows_out": out.rows, "dropped": dict(sorted(dropped.items())),
            "rejects": rej.rows}


def scan_local(cfg: CurateConfig, src: SourceConfig, files: list[str], tokenizer: str | None
               ) -> tuple[str, str | None, dict[str, Any]]:
    """`scan_to` into a fresh temp folder: (partial path, rejects path or None, counts)."""
    tmp = tempfile.mkdtemp(prefix="draftflow-scan-")
    try:
        out, rej = os.path.join(tmp, "part.parquet"), os.path.join(tmp, "rejected.parquet")
        counts = scan_to(out, rej, cfg, src, files, tokenizer)
        return out, (rej if counts["rejects"] else None), counts
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
