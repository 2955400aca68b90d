"""Built-in probe conversations for per-template facts (prefix stability).

Each group is one kind of conversation (reasoning in fields, reasoning inline), given as
variants to try in order: the first one the template can render decides. Variants drop the
system prompt (Gemma-2 refuses it) or add a probe tool (Hermes' tool_use template needs one).
"""

from __future__ import annotations

import logging
from typing import Any

from draftflow.errors import ConversationError

logger = logging.getLogger(__name__)

PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe_lookup",
        "description": "Look a word up.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
    },
}


def _conversation(inline: bool) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": "Probe system prompt."}]
    for k in range(3):
        out.append({"role": "user", "content": f"Probe question {k}?"})
        reasoning, answer = f"Probe reasoning {k}.", f"Probe answer {k}."
        if inline:
            out.append({"role": "assistant", "content": f"<think>\n{reasoning}\n</think>\n\n{answer}"})
        else:
            out.append({"role": "assistant", "content": answer, "reasoning_content": reasoning,
                        "thinking": reasoning})
    return out


def probe_conversations(with_tools: bool) -> list[list[tuple[list[dict[str, Any]], dict[str, Any]]]]:
    """Groups of (messages, extra template variables) variants, in the order to try them."""
    groups = []
    for inline in (False, True):
        full = _conversation(inline)
        variants = [(full, {}), (full[1:], {})]
        if with_tools:
            variants += [(full, {"tools": [PROBE_TOOL]}), (full[1:], {"tools": [PROBE_TOOL]})]
        groups.append(variants)
    return groups


def prefix_stable(chat: Any, kw: dict[str, Any]) -> bool:
    """Whether `chat` (a ChatFormat) encodes every renderable probe group under `all_turns`.

    Returns:
        False when a probe is not prefix-stable (or needs the target's ids), or none renders.
    """
    rendered = False
    for variants in probe_conversations(with_tools="tools" not in {**chat.template_kwargs, **kw}):
        for messages, extra in variants:
            try:
                chat.encode(messages, policy="all_turns", **kw, **extra)
            except ConversationError as exc:
                if getattr(exc, "reason", "") == "template_error":
                    continue
                logger.info("chat template is not prefix-stable: %s", exc)
                return False
            rendered = True
            break
    if not rendered:
        logger.warning("no probe conversation renders with this chat template; not prefix-stable")
    return rendered
