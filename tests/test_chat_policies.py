"""Policies, reason codes, prefix stability, {% generation %} agreement and batched encoding."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from draftflow.chat import REASONS, ChatFormat, EncodeRequest
from draftflow.errors import ConfigError, ConversationError
from tests.test_chat_cases import (
    CASES,
    QWEN3_TOKENIZER,
    TEMPLATE_NAMES,
    TEMPLATES,
    case,
    chat_format,
)
from tests.test_chat_templates import EXPECTED_ERRORS, check_rows, serving_ids

U = {"role": "user", "content": "Hi?"}
A = {"role": "assistant", "content": "Hello."}
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "42"}


@pytest.mark.parametrize(("messages", "reason"), [
    ([], "empty_conversation"),
    (["hello"], "malformed_message"),
    ([{"role": "robot", "content": "x"}], "unknown_role"),
    ([{"role": "user", "content": [{"type": "text", "text": "x"}]}], "non_text_content"),
    ([{"role": "system", "content": "Be brief."}], "no_user_turn"),
    ([U], "no_assistant_turn"),
    ([U, {"role": "assistant", "content": "  "}], "empty_content"),
    ([{"role": "user", "content": ""}, A], "empty_content"),
    ([A, U, A], "roles_out_of_order"),
    ([U, {"role": "system", "content": "late"}, A], "roles_out_of_order"),
    ([U, RESULT, A], "roles_out_of_order"),
    ([U, CALL, U, A], "tool_call_without_result"),
    ([U, CALL, {**RESULT, "tool_call_id": "other"}, A], "tool_call_without_result"),
    ([U, {**A, "tool_calls": [{"function": {}}]}], "malformed_message"),
])
def test_each_problem_has_one_line_and_a_reason_code(messages, reason):
    cf = chat_format("Qwen-Qwen2.5-7B-Instruct")
    with pytest.raises(ConversationError) as err:
        cf.encode(messages)
    assert err.value.reason == reason and reason in REASONS
    assert "\n" not in str(err.value)
    if reason == "no_assistant_turn":
        assert str(err.value) == "no assistant turn to supervise — run regenerate first"


def test_tool_calls_are_supervised_and_tool_results_are_not():
    cf = chat_format("Qwen-Qwen2.5-7B-Instruct")
    for messages in ([U, CALL, RESULT, A], [U, CALL]):  # a trailing call needs no result
        (row,) = cf.encode(messages)
        supervised = cf.tokenizer.decode([t for t, m in zip(row.input_ids, row.loss_mask) if m])
        assert '"name": "f"' in supervised and "42" not in supervised


def test_template_error_keeps_the_templates_message():
    cf = chat_format("google-gemma-2-2b-it")
    messages, _ = case("system", "google-gemma-2-2b-it")
    with pytest.raises(ConversationError, match="System role not supported") as err:
        cf.encode(messages)
    assert err.value.reason == "template_error"
    hermes = chat_format("NousResearch-Hermes-3-Llama-3.1-8B-tool_use")
    with pytest.raises(ConversationError) as err:  # its tool_use template needs `tools`
        hermes.encode([U, A])
    assert err.value.reason == "template_error"


def test_policies_on_a_template_that_drops_earlier_reasoning():
    cf = chat_format("Qwen-Qwen3-8B")
    messages, _ = case("reasoning_fields", "Qwen-Qwen3-8B")
    assert [r.turns for r in cf.encode(messages)] == [[1], [3]]  # auto: a new row per rewrite
    assert [r.turns for r in cf.encode(messages, policy="per_turn")] == [[1], [3]]
    assert [r.turns for r in cf.encode(messages, policy="last_turn")] == [[3]]
    with pytest.raises(ConversationError, match="per_turn or auto") as err:
        cf.encode(messages, policy="all_turns")
    assert err.value.reason == "not_prefix_stable"
    assert not cf.is_prefix_stable()
    assert chat_format("Qwen-Qwen2.5-7B-Instruct").is_prefix_stable()
    with pytest.raises(ConfigError, match="per_turn"):
        cf.encode(messages, policy="every_turn")


PREFIX_STABLE = {
    "HuggingFaceTB-SmolLM3-3B", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
    "Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-4B-Instruct-2507", "Qwen-Qwen3-Coder",
    "google-gemma-2-2b-it", "google-gemma-3-it", "huggingface-trl-qwen3_training",
    "meta-llama-Llama-3.1-8B-Instruct", "microsoft-Phi-3.5-mini-instruct",
    "microsoft-Phi-4-mini-instruct", "microsoft-phi-4", "microsoft-phi-4-initial-release",
    "moonshotai-Kimi-K2-Instruct",
}


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_is_prefix_stable_per_template(name):
    cf = chat_format(name)
    assert cf.is_prefix_stable() == (name in PREFIX_STABLE)
    if cf.is_prefix_stable():  # then all_turns gives one row on every case the template renders
        for case_name in CASES:
            if (name, case_name) not in EXPECTED_ERRORS:
                messages, kw = case(case_name, name)
                assert len(cf.encode(messages, policy="all_turns", **kw)) == 1


def test_qwen3_thinking_off_is_not_prefix_stable_either():
    """The prompt ends with an empty think block that later prompts do not show."""
    cf = chat_format("Qwen-Qwen3-8B")
    messages, _ = case("system", "Qwen-Qwen3-8B")
    assert not cf.is_prefix_stable(enable_thinking=False)
    with pytest.raises(ConversationError, match="per_turn or auto"):
        cf.encode(messages, policy="all_turns", enable_thinking=False)
    rows = cf.encode(messages, enable_thinking=False)
    assert [r.turns for r in rows] == [[2], [4]]


def test_gpt_oss_supervises_the_end_marker_the_target_emitted():
    name = "openai-gpt-oss-120b"
    cf, (messages, kw) = chat_format(name), case("tools", name)
    rows = cf.encode(messages, policy="per_turn", **kw)
    ends = [cf.tokenizer.decode(r.input_ids[r.spans[0][1] - 1 : r.spans[0][1]]) for r in rows]
    assert ends == ["<|call|>", "<|return|>", "<|return|>"]
    # later prompts show the final answer with <|end|>: auto starts a new row there
    assert "ANSWER_MARK1 It is 18C in Paris.<|end|>" in cf.tokenizer.decode(rows[2].input_ids)
    assert [r.turns for r in cf.encode(messages, **kw)] == [[1, 3], [5]]


def _target_ids(cf: ChatFormat, name: str, message: dict) -> list[int]:
    """What the target would emit after the serving prompt (test-side knowledge of the family)."""
    eos = cf.template_kwargs["eos_token"]
    if name.startswith("deepseek"):  # the prompt already opened <think>
        text = f"{message.get('reasoning_content') or ''}\n</think>\n\n{message['content']}{eos}"
    else:
        text = message["content"] + eos
    return cf.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(("name", "case_name"), [
    ("deepseek-ai-DeepSeek-R1", "reasoning_fields"),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "system"),
    ("mistralai-Mistral-Nemo-Instruct-2407", "system"),
])
def test_templates_that_need_completions_work_with_the_targets_ids(name, case_name):
    cf, (messages, kw) = chat_format(name), case(case_name, name)
    completions = {i: _target_ids(cf, name, m) for i, m in enumerate(messages) if m["role"] == "assistant"}
    for policy in ("auto", "per_turn", "last_turn"):
        rows = cf.encode(messages, completions, policy=policy, **kw)
        for row in rows:
            for turn, (start, end) in zip(row.turns, row.spans, strict=True):
                assert row.input_ids[:start] == serving_ids(name, messages[:turn], kw)
                assert row.input_ids[start:end] == completions[turn]
    assert cf.encode(messages, completions, policy="last_turn", **kw)[0].turns == [max(completions)]


TAGGED = ["HuggingFaceTB-SmolLM3-3B", "LiquidAI-LFM2.5-230M", "huggingface-trl-qwen3_training"]


@pytest.mark.parametrize("name", TAGGED)
def test_generation_tags_agree_with_the_derived_mask(name, caplog):
    """Rows of a tagged template (which intersect with transformers' assistant mask) equal the
    rows of the same template with the tags removed (derived mask only). The raw tag mask has
    more: the newline after the end marker (generation stops at the marker) and, for SmolLM3,
    the role header inside the block (it is part of the serving prompt, not generated)."""
    tagged = chat_format(name)
    assert tagged.has_generation_tags
    plain_text = re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", tagged.chat_template)
    plain = ChatFormat(tagged.tokenizer, plain_text, tagged.template_kwargs)
    for case_name in CASES:
        messages, kw = case(case_name, name)
        rows = tagged.encode(messages, **kw)
        assert rows == plain.encode(messages, **kw)
        check_rows(name, case_name, rows)
        row = rows[-1]
        ids, gen = tagged.generation_mask(messages[: row.turns[-1] + 1], **kw)
        assert ids[: len(row.input_ids)] == row.input_ids
        last_start = row.spans[-1][0]
        for j, (g, m) in enumerate(zip(gen, row.loss_mask)):
            assert m <= g  # every supervised token is inside a generation block
            if g and not m and j >= last_start:  # earlier ones are in the serving prompt
                before = tagged.tokenizer.decode(ids[j - 1 : j])
                assert before == "<|im_end|>" and not tagged.tokenizer.decode(ids[j : j + 1]).strip()
    assert "leaves" not in caplog.text


def test_encode_many_equals_encode_and_keeps_errors_in_place():
    cf = chat_format("Qwen-Qwen3-8B")
    convs = [case(c, "Qwen-Qwen3-8B") for c in CASES]
    requests = [EncodeRequest(m, None, kw) for m, kw in convs]
    requests.insert(1, EncodeRequest([U]))
    results = cf.encode_many(requests, policy="last_turn")
    assert results[1].reason == "no_assistant_turn"
    expected = [cf.encode(m, policy="last_turn", **kw) for m, kw in convs]
    assert [r for k, r in enumerate(results) if k != 1] == expected


def test_missing_chat_template_names_the_model(tmp_path):
    folder = tmp_path / "no-template-model"
    shutil.copytree(QWEN3_TOKENIZER, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="no-template-model"):
        ChatFormat.from_pretrained(folder)
    cf = ChatFormat.from_pretrained(folder, chat_template=(TEMPLATES / "Qwen-Qwen3-8B.jinja").read_text())
    assert cf.prompt_ids([U])
    with pytest.raises(ConfigError, match="not valid Jinja"):
        ChatFormat(cf.tokenizer, "{% if %}")
