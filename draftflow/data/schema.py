"""The canonical conversation schema (Arrow) shared by curate and every later stage.

A conversation row: `sample_id` (stable, hash of source and content, set at
curation and carried by every later stage), `source`, `split`, `messages`
(role, content, optional reasoning_content, tool_calls, tool_call_id, name)
and `tools`. Regenerate adds provenance columns; this module only defines the
shapes and parquet I/O helpers.

Tool data is nested JSON of no fixed shape, so it is stored as JSON strings
(`messages[].tool_calls`, `tools`) to keep the Arrow schemas simple.
`write_rows` / `read_rows` convert messages at the boundary (`to_stored` /
`from_stored`): in memory a message has `tool_calls` as a list (OpenAI shape,
arguments as a dict) and carries the tool keys only when they are set, so
chat templates see exactly the messages they saw before tools existed. The
conversation-level `tools` stays a JSON string everywhere (`json.loads` it).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

ROLES = ("system", "user", "assistant", "tool")

TOOL_KEYS = ("tool_calls", "tool_call_id", "name")
MESSAGE = pa.struct(
    [("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string()),
     ("tool_calls", pa.string()), ("tool_call_id", pa.string()), ("name", pa.string())]
)
CONVERSATION = pa.schema(
    [("sample_id", pa.string()), ("source", pa.string()), ("split", pa.string()), ("messages", pa.list_(MESSAGE)),
     ("tools", pa.string())]
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
# Curate's output also keeps each row's evaluation category (`SourceConfig.category` / `category_field`;
# null when the source sets none: reports then use the source's name). Later stages do not carry it.
CURATED = CONVERSATION.append(pa.field("category", pa.string()))
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
    """Stable id: sha256 of the source name and the canonical message content.

    Tool calls enter the hash only when present, so ids of plain chats are unchanged.
    """
    body = json.dumps([[m["role"], m["content"], *([m["tool_calls"]] if m.get("tool_calls") else [])]
                       for m in messages], ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(f"{source}\0{body}".encode()).hexdigest()[:16]


def message(role: str, content: str, reasoning: str | None = None, **tool: Any) -> dict[str, Any]:
    """A canonical message; `tool` takes tool_calls (list), tool_call_id and name, kept only when set."""
    out = {"role": role, "content": content, "reasoning_content": reasoning}
    out.update({k: v for k, v in tool.items() if k in TOOL_KEYS and v is not None})
    return out


def to_stored(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """In-memory messages -> the Arrow shape (tool_calls as a JSON string)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls is not None and not isinstance(calls, str):
            m = {**m, "tool_calls": json.dumps(calls, ensure_ascii=False, sort_keys=True)}
        out.append(m)
    return out


def from_stored(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Arrow messages -> in-memory messages (unset tool keys dropped, tool_calls parsed)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k not in TOOL_KEYS or v is not None}
        if isinstance(m.get("tool_calls"), str):
            m["tool_calls"] = json.loads(m["tool_calls"])
        out.append(m)
    return out


def write_rows(path: str, rows: list[dict[str, Any]], schema: pa.Schema) -> None:
    """Write rows to a local parquet file with a fixed schema (byte-stable output)."""
    if "messages" in schema.names:
        rows = [{**r, "messages": to_stored(r["messages"])} if r.get("messages") else r for r in rows]
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, path, compression="zstd")


def read_rows(path: str) -> list[dict[str, Any]]:
    """Read a parquet file as rows; conversation messages come back in their in-memory shape."""
    return rows_from_table(pq.read_table(path))


def rows_from_table(table: pa.Table) -> list[dict[str, Any]]:
    """A table's rows, with conversation messages in their in-memory shape."""
    rows = table.to_pylist()
    for r in rows:
        if r.get("messages"):
            r["messages"] = from_stored(r["messages"])
    return rows


def row_tools(row: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The conversation's tool schemas (stored as a JSON string), for the chat template."""
    raw = row.get("tools")
    if not raw:
        return None
    return json.loads(raw) if isinstance(raw, str) else raw


def template_kwargs(row: dict[str, Any], enable_thinking: bool) -> dict[str, Any]:
    """Template variables for rendering this conversation: thinking mode and its tools."""
    kw: dict[str, Any] = {"enable_thinking": enable_thinking}
    tools = row_tools(row)
    if tools:
        kw["tools"] = tools
    return kw
