"""Check a conversation before it reaches a chat template; one reason code per problem.

Every problem raises a one-line `ConversationError` whose `reason` attribute is one of `REASONS`,
so a stage can count rejected rows per reason. The checks are about the conversation's shape
(roles, order, tool calls and their results, text content), never about a model family: what a
particular template cannot render surfaces later as `template_error` with the template's message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from draftflow.chat.render import conversation_error

ROLES = ("system", "user", "assistant", "tool")
REASONS = (
    "empty_conversation",  # no messages
    "malformed_message",  # a message (or one of its tool calls) is not shaped as a dict
    "unknown_role",  # role outside ROLES
    "non_text_content",  # content (or reasoning) is not a string
    "no_user_turn",  # nothing for the target to answer
    "no_assistant_turn",  # nothing to supervise (prompt-only: run regenerate first)
    "empty_content",  # a user turn, or an assistant turn with no text, reasoning or tool call
    "roles_out_of_order",  # system not first, assistant/tool before the first user, stray tool
    "tool_call_without_result",  # an assistant tool call not answered before the next turn
    "template_error",  # the chat template raised (its own message is kept)
    "not_prefix_stable",  # all_turns on a template that rewrites earlier turns
    "needs_completions",  # the template's prompt is not a prefix of its rendered turn
    "bad_completions",  # completions keyed by a message that is not a supervisable turn
)

Message = Mapping[str, Any]


def _check_tool_calls(i: int, calls: Any) -> None:
    if not isinstance(calls, Sequence) or isinstance(calls, str):
        raise conversation_error("malformed_message", f"message {i} has tool_calls that is not a list")
    for call in calls:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise conversation_error(
                "malformed_message",
                f"message {i} has a tool call without function.name; use the OpenAI shape "
                '{"type": "function", "function": {"name": ..., "arguments": ...}}',
            )
        if not isinstance(fn.get("arguments", {}), (Mapping, str)):
            raise conversation_error(
                "malformed_message", f"message {i}: tool call arguments must be a dict or JSON text"
            )


def _check_message(i: int, message: Any) -> None:
    if not isinstance(message, Mapping):
        raise conversation_error(
            "malformed_message", f"message {i} is not a dict; each message needs role and content"
        )
    role = message.get("role")
    if role not in ROLES:
        raise conversation_error(
            "unknown_role", f"message {i} has unknown role {role!r}; use one of {', '.join(ROLES)}"
        )
    calls = message.get("tool_calls")
    if calls is not None and role != "assistant":
        raise conversation_error("malformed_message", f"message {i} ({role}) has tool_calls")
    if calls:
        _check_tool_calls(i, calls)
    content = message.get("content")
    if not isinstance(content, str) and not (calls and content is None):
        raise conversation_error(
            "non_text_content",
            f"message {i} ({role}) has {type(content).__name__} content; "
            "content must be a string (use '' for none)",
        )
    reasoning = message.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise conversation_error(
            "non_text_content", f"message {i} ({role}) has non-string reasoning_content"
        )
    if role in ("user", "assistant") and not (content or "").strip() and not calls and not reasoning:
        raise conversation_error("empty_content", f"message {i} ({role}) has empty content")


def _check_order(messages: Sequence[Message]) -> None:
    first = next(m["role"] for m in messages if m["role"] != "system")
    if first != "user":
        raise conversation_error(
            "roles_out_of_order", f"the first non-system message is {first}; it must be a user turn"
        )
    for i, m in enumerate(messages):
        role = m["role"]
        prev = messages[i - 1] if i else None
        if role == "system" and i > 0:
            raise conversation_error(
                "roles_out_of_order", f"system message at position {i}; a system prompt must come first"
            )
        if role == "tool" and not (
            prev["role"] == "tool" or (prev["role"] == "assistant" and prev.get("tool_calls"))
        ):
            raise conversation_error(
                "roles_out_of_order",
                f"tool message {i} does not follow an assistant tool call or another tool result",
            )
        if role == "assistant" and m.get("tool_calls") and i + 1 < len(messages):
            _check_results(messages, i)


def _check_results(messages: Sequence[Message], i: int) -> None:
    """The tool messages right after assistant message i answer its calls."""
    results = []
    for m in messages[i + 1 :]:
        if m["role"] != "tool":
            break
        results.append(m)
    if not results:
        raise conversation_error(
            "tool_call_without_result",
            f"assistant message {i} calls a tool but message {i + 1} is not a tool result",
        )
    wanted = {c.get("id") for c in messages[i]["tool_calls"]} - {None}
    answered = {m.get("tool_call_id") for m in results} - {None}
    if wanted and answered and wanted - answered:
        raise conversation_error(
            "tool_call_without_result",
            f"assistant message {i}: tool calls {sorted(wanted - answered)} have no tool result",
        )


def validate(messages: Sequence[Message]) -> None:
    """Check a conversation's shape.

    Args:
        messages: `{"role", "content", "reasoning_content"?, "tool_calls"?, ...}` dicts.

    Raises:
        ConversationError: with `reason` one of the shape codes of `REASONS` (not
            no_assistant_turn or the last four, which come from encoding and rendering).
    """
    if isinstance(messages, (str, Mapping)) or not messages:
        raise conversation_error("empty_conversation", "conversation is empty; drop it before tokenizing")
    for i, message in enumerate(messages):
        _check_message(i, message)
    if not any(m["role"] == "user" for m in messages):
        raise conversation_error(
            "no_user_turn", "conversation has no user turn; add one or drop the conversation at curation"
        )
    _check_order(messages)


def supervised_turns(
    messages: Sequence[Message], completions: Mapping[int, Sequence[int]] | None
) -> list[int]:
    """Assistant message indices to supervise, in order.

    With completions, supervision stops at the first assistant turn without generated ids:
    every later turn's history would hold an answer the target did not generate.

    Raises:
        ConversationError: `no_assistant_turn`, or `bad_completions` for keys that are not
            assistant messages.
    """
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant:
        raise conversation_error(
            "no_assistant_turn", "no assistant turn to supervise — run regenerate first"
        )
    if completions is None:
        return assistant
    stray = sorted(set(completions) - set(assistant))
    if stray:
        raise conversation_error(
            "bad_completions",
            f"completions given for messages {stray} that are not assistant turns; "
            "key completions by the assistant message index",
        )
    kept: list[int] = []
    for i in assistant:
        if not completions.get(i):
            break
        kept.append(i)
    return kept
