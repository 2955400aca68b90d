"""Shared fixtures for the chat tests (no tests here): every real template, its tokenizer, cases.

Every template is tested with the real Qwen3 tokenizer. A copy of it gets the template's marker
strings (`<|eot_id|>`, `<|start|>`, `<start_of_turn>`, `[INST]`, ...) as special tokens: in the
real model each marker is one atomic special token, so a turn boundary is a token boundary.
Without that, Qwen's BPE would split e.g. `<|eot_id|>` into pieces that can merge with the
neighbouring text, so the ids of a turn tokenized alone would differ from the same text inside
the next prompt — a tokenizer artefact, not what the template or serving does.
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path

from transformers import AutoTokenizer

from draftflow.chat import ChatFormat

FIXTURES = Path(__file__).parent / "fixtures"
QWEN3_TOKENIZER = FIXTURES / "tokenizers" / "qwen3"
TEMPLATES = FIXTURES / "chat_templates"
GOLDEN = FIXTURES / "golden"
TEMPLATE_NAMES = sorted(p.stem for p in TEMPLATES.glob("*.jinja"))

# The family's own bos/eos strings, so `{{ bos_token }}` renders as in the real model.
SPECIAL_KWARGS = {
    "meta-llama-Llama-3.1-8B-Instruct": {"bos_token": "<|begin_of_text|>"},
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": {"bos_token": "<|begin_of_text|>"},
    "google-gemma-2-2b-it": {"bos_token": "<bos>"},
    "google-gemma-3-it": {"bos_token": "<bos>"},
    "deepseek-ai-DeepSeek-R1": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": {
        "bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
    "mistralai-Mistral-Nemo-Instruct-2407": {"bos_token": "<s>", "eos_token": "</s>"},
    "microsoft-Phi-3.5-mini-instruct": {"eos_token": "<|endoftext|>"},
    "microsoft-Phi-4-mini-instruct": {"eos_token": "<|endoftext|>"},
    "LiquidAI-LFM2.5-230M": {"bos_token": "<|startoftext|>"},
}
MARKER = re.compile(
    r"<\|[A-Za-z0-9_]+\|>|<｜[^｜<>]+｜>|\[/?[A-Z_]{3,}\]|<(?:start|end)_of_turn>|\[gMASK\]|<sop>"
)

# Unique strings, so the tests can tell whose text ended up supervised.
SYSTEM = "SYSTEM_MARK Be concise."
TOOL_RESULT = '{"temperature": "TOOL_RESULT_MARK 18C"}'
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _turns(reasoning: str | None) -> list[dict]:
    out = []
    for k, (q, a) in enumerate([("capital of France", "Paris is it."), ("2+2", "It equals 4.")]):
        out.append({"role": "user", "content": f"USER_MARK{k} What is {q}?"})
        msg = {"role": "assistant", "content": f"ANSWER_MARK{k} {a}"}
        why = f"REASON_MARK{k} thinking it over"
        if reasoning == "fields":
            msg.update(reasoning_content=why, thinking=why)
        elif reasoning == "inline":
            msg["content"] = f"<think>\n{why}\n</think>\n\n{msg['content']}"
        out.append(msg)
    return out


def _tool_conversation(string_args: bool) -> list[dict]:
    args = '{"city": "Paris"}' if string_args else {"city": "Paris"}
    call = {"id": "abc123XYZ", "type": "function", "function": {"name": "get_weather", "arguments": args}}
    return [
        {"role": "user", "content": "USER_MARK0 What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "abc123XYZ", "name": "get_weather", "content": TOOL_RESULT},
        {"role": "assistant", "content": "ANSWER_MARK1 It is 18C in Paris."},
        {"role": "user", "content": "USER_MARK2 Thanks. And tomorrow?"},
        {"role": "assistant", "content": "ANSWER_MARK2 Probably the same."},
    ]


def case(name: str, template: str) -> tuple[list[dict], dict]:
    """(messages, template kwargs) of one conversation case for one template."""
    # Hermes' tool_use template iterates `tools` unconditionally: it always needs them.
    kw = {"tools": [WEATHER_TOOL]} if template.startswith("NousResearch") else {}
    if name == "system":
        return [{"role": "system", "content": SYSTEM}, *_turns(None)], kw
    if name in ("reasoning_fields", "reasoning_inline"):
        return _turns(name.split("_")[1]), kw
    string_args = template.startswith("deepseek-ai-DeepSeek-R1")
    return _tool_conversation(string_args), {"tools": [WEATHER_TOOL]}


CASES = ("system", "reasoning_fields", "reasoning_inline", "tools")
FOREIGN = ("SYSTEM_MARK", "USER_MARK", "TOOL_RESULT_MARK")


@functools.cache
def qwen_tokenizer():
    return AutoTokenizer.from_pretrained(QWEN3_TOKENIZER)


@functools.cache
def marker_tokenizer():
    """One Qwen3 tokenizer copy with the markers of every template as special tokens.

    One shared copy (the union of all markers) keeps the tests fast; no template's text
    contains another family's markers, so the extra tokens change nothing else.
    """
    tok = copy.deepcopy(qwen_tokenizer())
    markers = {m for p in TEMPLATES.glob("*.jinja") for m in MARKER.findall(p.read_text())}
    markers |= {v for kw in SPECIAL_KWARGS.values() for v in kw.values()}
    new = sorted(m for m in markers if m not in tok.get_vocab())
    # Atomic and special (skipped when decoding); unlike add_special_tokens, one spelling for
    # transformers 4 and 5 (5 renamed additional_special_tokens to extra_special_tokens).
    tok.add_tokens(new, special_tokens=True)
    return tok


@functools.cache
def chat_format(name: str) -> ChatFormat:
    """ChatFormat for template `name` over the marker tokenizer, with the family's bos/eos."""
    text = (TEMPLATES / f"{name}.jinja").read_text()
    return ChatFormat(marker_tokenizer(), text, dict(SPECIAL_KWARGS.get(name, {})), name=name)
