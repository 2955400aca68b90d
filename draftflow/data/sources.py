"""Source readers and format adapters: raw rows -> canonical messages.

Readers stream rows from JSONL (plain or compressed, by extension) and parquet
through fsspec, so `s3://` works like a local path. Each adapter is a small
function from one raw row to messages; it raises `BadRow(reason)` for rows it
cannot convert, and the caller counts and keeps them as rejects.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import fsspec

from draftflow.config import SourceConfig
from draftflow.data.schema import ROLES, message
from draftflow.errors import SourceError


class BadRow(Exception):
    """A row that cannot be used; `reason` is a short code counted in the manifest."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


def check_source(src: SourceConfig) -> None:
    """Fail at stage start, before any work, when a source cannot be reached."""
    try:
        fs, path = fsspec.core.url_to_fs(src.path)
        found = fs.exists(path)
    except Exception as exc:  # a bad URL, missing credentials, unknown protocol
        raise SourceError(f"source '{src.name}': cannot reach {src.path} ({exc})") from None
    if not found:
        raise SourceError(f"source '{src.name}': path {src.path} does not exist; fix curate.sources[].path")


def read_source(src: SourceConfig) -> Iterator[dict[str, Any] | BadRow]:
    """Yield raw rows (dicts) of one source, or `BadRow` for unparsable lines."""
    path = src.path
    if path.endswith(".parquet"):
        yield from _read_parquet(path)
    else:
        yield from _read_jsonl(path)


def _read_jsonl(path: str) -> Iterator[dict[str, Any] | BadRow]:
    with fsspec.open(path, "rb", compression="infer") as fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                yield BadRow("invalid_utf8", f"line {lineno}")
                continue
            except json.JSONDecodeError as exc:
                yield BadRow("malformed_json", f"line {lineno}: {exc.msg}; {raw[:200]!r}")
                continue
            yield row if isinstance(row, dict) else BadRow("not_an_object", f"line {lineno}")


def _read_parquet(path: str) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    with fsspec.open(path, "rb") as fh:
        pf = pq.ParquetFile(fh)
        for batch in pf.iter_batches(batch_size=1024):
            yield from batch.to_pylist()


def _text(value: Any, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise BadRow("non_text_content", f"{where} is {type(value).__name__}, not text")
    return value


SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
    "system": "system", "tool": "tool", "function": "tool", "observation": "tool",
}


def from_sharegpt(row: dict[str, Any]) -> list[dict[str, Any]]:
    """ShareGPT: `conversations: [{from, value}]`."""
    out = []
    for i, turn in enumerate(row.get("conversations") or []):
        role = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
        if role is None:
            raise BadRow("unknown_role", f"turn {i} has from={turn.get('from')!r}")
        out.append(message(role, _text(turn.get("value"), f"turn {i} value")))
    return out


def from_openai(row: dict[str, Any]) -> list[dict[str, Any]]:
    """OpenAI messages: `messages: [{role, content, reasoning_content?}]`."""
    out = []
    for i, m in enumerate(row.get("messages") or []):
        role = m.get("role")
        if role not in ROLES:
            raise BadRow("unknown_role", f"message {i} has role={role!r}")
        reasoning = m.get("reasoning_content")
        out.append(message(role, _text(m.get("content"), f"message {i} content"), reasoning or None))
    return out


def from_alpaca(row: dict[str, Any]) -> list[dict[str, Any]]:
    """Alpaca: `instruction`, optional `input`, `output`."""
    instruction = _text(row.get("instruction"), "instruction")
    extra = _text(row.get("input"), "input")
    prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return [message("user", prompt), message("assistant", _text(row.get("output"), "output"))]


ADAPTERS: dict[str, Callable[[dict[str, Any]], list[dict[str, Any]]]] = {
    "sharegpt": from_sharegpt,
    "openai": from_openai,
    "alpaca": from_alpaca,
}
DETECT = (("conversations", "sharegpt"), ("messages", "openai"), ("instruction", "alpaca"))


def to_messages(row: dict[str, Any], fmt: str) -> list[dict[str, Any]]:
    """Convert one raw row; `fmt='auto'` detects the shape from its columns."""
    if fmt == "auto":
        fmt = next((name for col, name in DETECT if col in row), "")
        if not fmt:
            raise BadRow("unknown_format", f"columns {sorted(row)[:8]} match no known format")
    messages = ADAPTERS[fmt](row)
    if not messages:
        raise BadRow("empty_conversation")
    return messages
