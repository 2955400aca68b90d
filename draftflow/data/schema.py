"""The canonical conversation schema (Arrow) shared by curate and every later stage.

A conversation row: `sample_id` (stable, hash of source and content, set at
curation and carried by every later stage), `source`, `split`, and `messages`
(role, content, optional reasoning_content). Regenerate adds provenance
columns; this module only defines the shapes and parquet I/O helpers.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

ROLES = ("system", "user", "assistant", "tool")

MESSAGE = pa.struct(
    [("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string())]
)
CONVERSATION = pa.schema(
    [("sample_id", pa.string()), ("source", pa.string()), ("split", pa.string()), ("messages", pa.list_(MESSAGE))]
)
TURN = pa.struct(
    [
        ("turn", pa.int32()),
        ("ids", pa.list_(pa.int32())),
        ("finish_reason", pa.string()),
        ("prompt_tokens", pa.int32()),
        ("completion_tokens", pa.int32()),
    ]
)
REGENERATED = CONVERSATION.append(pa.field("generated", pa.list_(TURN))).append(
    pa.field("provenance", pa.string())
).append(pa.field("enable_thinking", pa.bool_())).append(pa.field("finish_reason", pa.string()))
REJECTED = pa.schema([("source", pa.string()), ("reason", pa.string()), ("detail", pa.string()), ("row", pa.string())])
TOKENIZED = pa.schema(
    [
        ("sample_id", pa.string()),
        ("row", pa.int32()),
        ("turns", pa.list_(pa.int32())),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
    ]
)


def sample_id(source: str, messages: list[dict[str, Any]]) -> str:
    """Stable id: sha256 of the source name and the canonical message content."""
    body = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(f"{source}\0{body}".encode()).hexdigest()[:16]


def message(role: str, content: str, reasoning: str | None = None) -> dict[str, Any]:
    return {"role": role, "content": content, "reasoning_content": reasoning}


def write_rows(path: str, rows: list[dict[str, Any]], schema: pa.Schema) -> None:
    """Write rows to a local parquet file with a fixed schema (byte-stable output)."""
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, path, compression="zstd")


def read_rows(path: str) -> list[dict[str, Any]]:
    return pq.read_table(path).to_pylist()
