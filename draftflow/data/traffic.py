"""Traffic: request logs of an OpenAI-compatible server as conversations (what `draftflow refresh` reads).

A log is a folder (or S3 prefix) of JSON Lines files (.jsonl, .jsonl.gz, .jsonl.zst), one chat-completions
request per line: `messages`, optional `tools`, and the response where the logger kept one, either as
`response` (a chat-completions response, `{"choices": [{"message": ...}]}`, or the assistant message itself)
or as `choices` beside the request. This is what clients send to vLLM or any OpenAI-compatible server; a proxy
or the server's request log writes it.

`conversation(row)` turns one logged request into a row the `openai` adapter reads (`messages`, `tools`), or
raises `BadRow(reason)`: `no_user_turn` (nothing a user asked), the adapter's own reasons (`unknown_role`,
`non_text_content`, ...), `missing_messages`. Reading lines and their JSON errors is `readers.read_file`'s.
`holdout(row, fraction)` decides, from the row's content alone, whether it joins the "recent traffic" eval slice.

What it does not know: watermarks, batches, run roots (`draftflow.refresh`). This module does no I/O but listing.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from draftflow.data.sources import BadRow, from_openai

SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json")


def log_files(path: str) -> list[tuple[str, int]]:
    """(file URL, size) of every log file under `path` (a folder, an S3 prefix or one file), sorted by name.

    Raises:
        FileNotFoundError: nothing is at `path` (the caller names the setting).
    """
    import fsspec

    fs, where = fsspec.core.url_to_fs(path)
    if not fs.exists(where):
        raise FileNotFoundError(path)
    if fs.isdir(where):
        found = {p: info for p, info in fs.find(where, detail=True).items() if p.endswith(SUFFIXES)}
    else:
        found = {where: fs.info(where)}
    out = [(fs.unstrip_protocol(p) if "://" in path else p, int(info.get("size") or 0)) for p, info in found.items()]
    return sorted(out)


def _response_message(row: dict[str, Any]) -> dict[str, Any] | None:
    """The logged assistant answer: `response` (a completion or a message) or `choices` beside the request."""
    response = row.get("response", row)
    if not isinstance(response, dict):
        return None
    choices = response.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        message = choices[0].get("message")
        return message if isinstance(message, dict) else None
    return response if response is not row and response.get("role") == "assistant" else None


def conversation(row: dict[str, Any]) -> dict[str, Any]:
    """One logged request (and its response, when logged) as `{messages, tools}` for the `openai` adapter.

    Raises:
        BadRow: `missing_messages`, `no_user_turn`, or the adapter's reason for a message it cannot read.
    """
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRow("missing_messages", "no `messages` list (an OpenAI chat-completions request has one)")
    answer = _response_message(row)
    if answer is not None:
        messages = [*messages, {k: v for k, v in answer.items() if k in ("role", "content", "tool_calls",
                                                                       "reasoning_content")} | {"role": "assistant"}]
    out = {"messages": messages, **({"tools": row["tools"]} if row.get("tools") else {})}
    parsed = from_openai(out)  # the adapter's checks now: a bad row is counted here, by its reason
    if not any(m["role"] == "user" and m["content"].strip() for m in parsed):
        raise BadRow("no_user_turn", "no user message with text: nothing a user asked")
    return out


def holdout(row: dict[str, Any], fraction: float) -> bool:
    """Whether `row` joins the recent-traffic eval slice: a stable hash of its messages, so a batch read again
    after a crash splits the same way."""
    digest = hashlib.sha256(json.dumps(row["messages"], sort_keys=True).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction
