"""Regenerating conversations turn by turn: what to feed the target, what to keep, where to cut.

A source conversation becomes groups of non-assistant messages, each answered
by one generated assistant turn, in order, conditioned on the regenerated
history. Tool-calling conversations keep the source's tool results only when
the regenerated call is the source's call (same names and arguments); otherwise
the result no longer answers it and the conversation is cut before it.
Tool calls are parsed from text in the Hermes/Qwen `<tool_call>{json}</tool_call>`
form (or taken from an engine that returns them). This module knows nothing of
shards, stores or engines beyond `Completion`.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from draftflow.engines.base import Completion

TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@dataclass
class Dialog:
    """One conversation being regenerated."""

    row: dict[str, Any]
    groups: list[list[dict]]  # non-assistant messages, each group answered by one reply
    source_calls: list[Any]  # the source's tool calls of reply k (None when it made none)
    thinking: bool = False
    history: list[dict] = field(default_factory=list)
    generated: list[dict] = field(default_factory=list)
    failed: tuple[str, str] | None = None  # (reason, detail)
    cut: str | None = None  # why the conversation ends early, if it does

    def has_next(self) -> bool:
        return self.failed is None and self.cut is None and len(self.generated) < len(self.groups)


def _copy(m: dict) -> dict:
    keep = ("role", "content", "reasoning_content", "tool_call_id", "name")
    return {k: m[k] for k in keep if m.get(k) is not None or k == "content"}


def plan_dialog(row: dict[str, Any], thinking: bool = False) -> Dialog:
    """Groups of prompt messages, each followed by a reply where the source had one
    (and after a final user or tool message)."""
    groups: list[list[dict]] = [[]]
    calls: list[Any] = []
    for m in row["messages"]:
        if m["role"] != "assistant":
            groups[-1].append(_copy(m))
        elif groups[-1]:
            calls.append(m.get("tool_calls"))
            groups.append([])
    if not groups[-1]:
        groups.pop()
    calls += [None] * (len(groups) - len(calls))
    return Dialog(row=row, groups=groups, source_calls=calls, thinking=thinking)


def thinking_for(row: dict[str, Any], setting: bool | float, seed: int) -> bool:
    """`enable_thinking` for this conversation: fixed, or on for a seeded fraction of ids."""
    if isinstance(setting, bool):
        return setting
    h = hashlib.sha256(f"{seed}:{row['sample_id']}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < setting


def _canonical_calls(calls: Any) -> list[tuple[str, str]] | None:
    if not calls:
        return None
    out = []
    for c in calls:
        fn = c.get("function", c)
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        out.append((fn.get("name"), json.dumps(args, sort_keys=True)))
    return out


def calls_match(generated: Any, source: Any) -> bool:
    """Same tool names and arguments, in order (argument key order does not matter)."""
    return _canonical_calls(generated) == _canonical_calls(source)


def next_group(d: Dialog) -> list[dict] | None:
    """The messages to feed before the next reply, or None when the dialog is cut here."""
    k = len(d.generated)
    group = d.groups[k]
    if group and group[0]["role"] == "tool" and k > 0:
        if not calls_match(d.history[-1].get("tool_calls"), d.source_calls[k - 1]):
            d.cut = "cut_before_tool_result"
            return None
    return group


def parse_tool_calls(text: str) -> tuple[str, list[dict] | None]:
    """Split Hermes/Qwen-style `<tool_call>{"name", "arguments"}</tool_call>` blocks off the text."""
    calls = []
    for m in TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            return text, None  # not a well-formed call: keep it as text
        calls.append({"type": "function", "function": {"name": obj.get("name"), "arguments": obj.get("arguments")}})
    if not calls:
        return text, None
    return TOOL_CALL.sub("", text).strip(), calls


def split_reasoning(text: str) -> tuple[str | None, str]:
    """Separate `<think>…</think>` reasoning from the answer text."""
    if "</think>" not in text:
        return None, text
    reasoning, content = text.split("</think>", 1)
    return reasoning.replace("<think>", "").strip() or None, content.lstrip("\n")


def apply_completion(d: Dialog, c: Completion) -> None:
    """Append the generated assistant turn (or mark the dialog failed)."""
    if c.finish_reason == "prompt_too_long":
        d.failed = ("prompt_too_long", f"prompt of {c.prompt_tokens} tokens exceeds the model's context")
        return
    if c.reasoning is not None:
        reasoning, text = c.reasoning, c.text
    else:
        reasoning, text = split_reasoning(c.text)
    calls = getattr(c, "tool_calls", None)
    if calls is None:
        text, calls = parse_tool_calls(text)
    if not text.strip() and not calls and not reasoning:
        d.failed = ("empty_response", f"turn {len(d.history)}: the target produced no text")
        return
    msg = {"role": "assistant", "content": text, "reasoning_content": reasoning}
    if calls:
        msg["tool_calls"] = calls
    d.generated.append({"turn": len(d.history), "ids": c.ids or [], "finish_reason": c.finish_reason,
                        "prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens})
    d.history.append(msg)
