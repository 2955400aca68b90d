"""Golden tests of draftflow.chat on every real template in tests/fixtures/chat_templates.

For each template and conversation case (system prompt + two turns, reasoning as fields,
reasoning inline, tool call + tool result + two answers), under the policies:

- every row's ids before each supervised span equal `apply_chat_template(history,
  add_generation_prompt=True, tokenize=True)` through transformers itself (serving);
- every supervised span decodes to that turn's own output only (its answer marker, its reasoning
  when the template renders it, its tool call when the template renders calls) and ends with the
  template's end-of-turn marker; no system/user/tool text, no role header; masks never all zero;
- `last_turn` is the last `per_turn` row, `all_turns` equals `auto` when that is one row and
  raises `not_prefix_stable` otherwise;
- a case the template cannot support is a counted reason, never a crash (table below);
- the rows equal the golden file tests/fixtures/golden/<template>.json. The loss mask is stored
  as its supervised spans [start, end). Regenerate after an intended change with
  `DRAFTFLOW_UPDATE_GOLDEN=1 python -m pytest tests/test_chat_templates.py` and review the diff.
"""

from __future__ import annotations

import json
import os

import pytest

from draftflow.chat import EncodedRow
from draftflow.chat.render import fixed_strftime_now
from draftflow.errors import ConversationError
from tests.test_chat_cases import CASES, FOREIGN, GOLDEN, TEMPLATE_NAMES, case, chat_format

UPDATE = os.environ.get("DRAFTFLOW_UPDATE_GOLDEN") == "1"
STORED_POLICIES = ("auto", "per_turn")

# Serving renders templates that call strftime_now (gpt-oss, SmolLM3) with the same fixed date.
FIXED = {"strftime_now": fixed_strftime_now}
EXPECTED_ERRORS = {
    # the generation prompt opens <think>, the rendered turn has its reasoning stripped
    **{(t, c): "needs_completions" for t in ("deepseek-ai-DeepSeek-R1",
                                             "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B") for c in CASES},
    # after a tool turn the prompt's layout differs from the rendered assistant turn
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "tools"): "needs_completions",
    # the system text moves into the last user turn only while that is the last message
    ("mistralai-Mistral-Nemo-Instruct-2407", "system"): "needs_completions",
    ("google-gemma-2-2b-it", "system"): "template_error",  # "System role not supported"
    ("google-gemma-2-2b-it", "tools"): "template_error",  # roles must alternate
    ("google-gemma-3-it", "tools"): "template_error",
}
END_MARKERS = {
    "meta-llama-Llama-3.1-8B-Instruct": ("<|eot_id|>",),
    "openai-gpt-oss-120b": ("<|return|>", "<|call|>"),
    "google-gemma-2-2b-it": ("<end_of_turn>",),
    "google-gemma-3-it": ("<end_of_turn>",),
    "microsoft-Phi-3.5-mini-instruct": ("<|end|>",),
    "microsoft-Phi-4-mini-instruct": ("<|end|>",),
    "mistralai-Mistral-Nemo-Instruct-2407": ("</s>",),
    # GLM-4.x renders no end-of-turn marker (the next role header ends a turn): derived
    # completions end with the answer; regenerate's ids carry the real stop token.
    "zai-org-GLM-4.6.llamacpp-patched": ("",),
}
CALLS_NOT_RENDERED = {
    "HuggingFaceTB-SmolLM3-3B", "microsoft-Phi-3.5-mini-instruct", "microsoft-Phi-4-mini-instruct",
    "microsoft-phi-4", "microsoft-phi-4-initial-release",
}


def encode(name: str, case_name: str, policy: str) -> list[EncodedRow] | str:
    cf = chat_format(name)
    messages, kw = case(case_name, name)
    try:
        return cf.encode(messages, policy=policy, **kw)
    except ConversationError as exc:
        assert "\n" not in str(exc)
        return exc.reason


def serving_ids(name: str, messages, kw) -> list[int]:
    cf = chat_format(name)
    return list(cf.tokenizer.apply_chat_template(
        messages, chat_template=cf.chat_template, add_generation_prompt=True, tokenize=True,
        return_dict=False, **FIXED, **cf.template_kwargs, **kw))


def check_span(name: str, messages, kw, turn: int, text: str) -> None:
    """What one supervised span may and must contain."""
    cf = chat_format(name)
    own = messages[turn]
    assert text.endswith(END_MARKERS.get(name, ("<|im_end|>",))), text
    assert text == text.rstrip(), "whitespace after the end marker is not supervised"
    assert not any(f in text for f in FOREIGN), text
    assert "user" not in text.lower() and "system" not in text.lower(), text
    marks = [m for m in ("ANSWER_MARK0", "ANSWER_MARK1", "ANSWER_MARK2") if m in own["content"]]
    assert all(m in text for m in marks), text
    others = {"ANSWER_MARK0", "ANSWER_MARK1", "ANSWER_MARK2"} - set(marks)
    assert not any(m in text for m in others), text
    if own.get("tool_calls"):
        assert ("get_weather" in text) != (name in CALLS_NOT_RENDERED), text
    full = cf.tokenizer.apply_chat_template(messages[: turn + 1], chat_template=cf.chat_template,
                                            tokenize=False, **FIXED, **cf.template_kwargs, **kw)
    for reason in ("REASON_MARK0", "REASON_MARK1"):
        if reason in str(own.get("reasoning_content")) + own["content"]:
            assert (reason in text) == (reason in full), text


def check_rows(name: str, case_name: str, rows: list[EncodedRow]) -> None:
    cf = chat_format(name)
    messages, kw = case(case_name, name)
    assert rows
    for row in rows:
        assert len(row.input_ids) == len(row.loss_mask) and any(row.loss_mask)
        assert sum(row.loss_mask) == sum(end - start for start, end in row.spans)
        for turn, (start, end) in zip(row.turns, row.spans, strict=True):
            assert messages[turn]["role"] == "assistant"
            assert all(row.loss_mask[start:end])
            assert row.input_ids[:start] == serving_ids(name, messages[:turn], kw), (turn, start)
            check_span(name, messages, kw, turn, cf.tokenizer.decode(row.input_ids[start:end]))


def as_json(result: list[EncodedRow] | str) -> object:
    if isinstance(result, str):
        return {"error": result}
    return [{"turns": r.turns, "loss_mask_spans": [list(s) for s in r.spans], "input_ids": r.input_ids}
            for r in result]


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_every_template_every_case(name):
    golden: dict[str, dict[str, object]] = {}
    for case_name in CASES:
        results = {p: encode(name, case_name, p) for p in ("auto", "per_turn", "last_turn", "all_turns")}
        expected_error = EXPECTED_ERRORS.get((name, case_name))
        if expected_error:
            assert {results[p] for p in ("auto", "per_turn", "all_turns")} == {expected_error}
            if not isinstance(results["last_turn"], str):  # the failing turn is not the last
                check_rows(name, case_name, results["last_turn"])
        else:
            for policy in ("auto", "per_turn"):
                check_rows(name, case_name, results[policy])
            assert results["last_turn"] == results["per_turn"][-1:]
            single = len(results["auto"]) == 1
            assert results["all_turns"] == (results["auto"] if single else "not_prefix_stable")
            assert len(results["per_turn"]) == sum(len(r.turns) for r in results["auto"])
        golden[case_name] = {p: as_json(results[p]) for p in STORED_POLICIES}
    path = GOLDEN / f"{name}.json"
    if UPDATE:
        path.write_text(json.dumps(golden, separators=(",", ":")) + "\n")
    assert path.exists(), "no golden file; run with DRAFTFLOW_UPDATE_GOLDEN=1 and review it"
    assert json.loads(path.read_text()) == golden


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_direct_render_equals_apply_chat_template(name):
    """The compiled-template fast path gives transformers' text (or both fail) on every prefix."""
    cf = chat_format(name)
    for case_name in CASES:
        messages, kw = case(case_name, name)
        for k in range(1, len(messages) + 1):
            for agp in (False, True):
                try:
                    want = cf.tokenizer.apply_chat_template(
                        messages[:k], chat_template=cf.chat_template, tokenize=False,
                        add_generation_prompt=agp, **FIXED, **cf.template_kwargs, **kw)
                except Exception:  # noqa: BLE001 - whatever the template raises
                    want = None
                try:  # the renderer itself: prefixes need not be valid conversations
                    got = cf.renderer.render(messages[:k], agp, {**cf.template_kwargs, **kw})
                except ConversationError as exc:
                    assert exc.reason == "template_error", exc
                    got = None
                assert got == want, (case_name, k, agp)
