"""Golden tests for draftflow.chat on real chat templates (fixtures copied from shared/).

The invariant checked for every template: each supervised span is preceded by exactly the ids
`apply_chat_template(history, add_generation_prompt=True, tokenize=True)` gives (what vLLM and
SGLang feed the target), and it decodes to what the target generates: the turn's text plus the
end-of-turn marker, without the template's newline after it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from draftflow.chat import ChatFormat, EncodedRow
from draftflow.errors import ConversationError, DraftflowError

FIXTURES = Path(__file__).parent / "fixtures"
QWEN3_TOKENIZER = FIXTURES / "tokenizers" / "qwen3"
TEMPLATES = FIXTURES / "chat_templates"
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

TWO_TURNS = [
    {"role": "user", "content": "What is the capital of France?"},
    {
        "role": "assistant",
        "content": "Paris is the capital.",
        "reasoning_content": "A geography question.",
    },
    {"role": "user", "content": "And 2+2?"},
    {"role": "assistant", "content": "2+2 equals 4.", "reasoning_content": "Simple arithmetic."},
]
PLAIN_TWO_TURNS = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in TWO_TURNS]


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


@pytest.fixture(scope="session")
def qwen_tok():
    return AutoTokenizer.from_pretrained(QWEN3_TOKENIZER)


@pytest.fixture(scope="session")
def llama_tok(qwen_tok):
    """The Qwen tokenizer plus Llama-3's marker strings as atomic special tokens.

    Only the template's text logic is under test, so Qwen's BPE is fine for the rest.
    """
    tok = copy.deepcopy(qwen_tok)
    tok.add_tokens(LLAMA_SPECIALS, special_tokens=True)  # add_special_tokens' keys differ in transformers 4 and 5
    return tok


def spans(mask: list[int]) -> list[tuple[int, int]]:
    """Contiguous runs of 1 in a mask, as (start, end)."""
    out, start = [], None
    for j, m in enumerate([*mask, 0]):
        if m and start is None:
            start = j
        elif not m and start is not None:
            out.append((start, j))
            start = None
    return out


def check_rows(
    cf: ChatFormat, messages, rows: list[EncodedRow], expected: dict[int, str], **kw
) -> None:
    """The serving-prefix and supervised-text invariants for every row and span."""
    tok = cf.tokenizer
    seen = []
    for row in rows:
        assert len(row.input_ids) == len(row.loss_mask)
        assert any(row.loss_mask), "mask is all zero"
        row_spans = spans(row.loss_mask)
        assert len(row_spans) == len(row.turns)
        for (start, end), turn in zip(row_spans, row.turns, strict=True):
            history = messages[:turn]
            served = tok.apply_chat_template(
                history,
                chat_template=cf.chat_template,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,  # ids, as vLLM asks for them (transformers 5 defaults to a dict)
                **cf.template_kwargs,
                **kw,
            )
            assert row.input_ids[:start] == list(served), (
                f"turn {turn}: context differs from serving"
            )
            text = tok.decode(row.input_ids[start:end])
            assert text == expected[turn]
            assert not text.endswith("\n")
            seen.append(turn)
    assert seen == sorted(expected)


# -- golden tests on real templates ------------------------------------------------------------


def test_qwen3_thinking_drops_history_reasoning_so_each_turn_is_its_own_row(qwen_tok):
    cf = ChatFormat(qwen_tok, template("Qwen-Qwen3-8B"))
    rows = cf.encode(TWO_TURNS)
    assert [r.turns for r in rows] == [[1], [3]]
    check_rows(
        cf,
        TWO_TURNS,
        rows,
        {
            1: "<think>\nA geography question.\n</think>\n\nParis is the capital.<|im_end|>",
            3: "<think>\nSimple arithmetic.\n</think>\n\n2+2 equals 4.<|im_end|>",
        },
    )
    # Serving's history for turn 3 has no reasoning for turn 1, so neither does row 2.
    assert "geography" not in qwen_tok.decode(rows[1].input_ids)


def test_qwen3_thinking_off_supervises_the_answer_after_the_empty_think_block(qwen_tok):
    cf = ChatFormat(qwen_tok, template("Qwen-Qwen3-8B"), {"enable_thinking": False})
    rows = cf.encode(PLAIN_TWO_TURNS)
    check_rows(
        cf,
        PLAIN_TWO_TURNS,
        rows,
        {1: "Paris is the capital.<|im_end|>", 3: "2+2 equals 4.<|im_end|>"},
    )
    assert qwen_tok.decode(rows[0].input_ids).endswith(
        "assistant\n<think>\n\n</think>\n\nParis is the capital.<|im_end|>"
    )


def test_qwen3_tokenizer_folder_carries_the_qwen3_template(qwen_tok):
    cf = ChatFormat.from_pretrained(QWEN3_TOKENIZER)
    assert cf.chat_template == template("Qwen-Qwen3-8B")
    assert cf.prompt_ids(TWO_TURNS[:1]) == ChatFormat(
        qwen_tok, template("Qwen-Qwen3-8B")
    ).prompt_ids(TWO_TURNS[:1])


def test_qwen25_default_system_prompt_and_one_row_per_conversation(qwen_tok):
    cf = ChatFormat(qwen_tok, template("Qwen-Qwen2.5-7B-Instruct"))
    rows = cf.encode(PLAIN_TWO_TURNS)
    assert [r.turns for r in rows] == [[1, 3]]
    check_rows(
        cf,
        PLAIN_TWO_TURNS,
        rows,
        {1: "Paris is the capital.<|im_end|>", 3: "2+2 equals 4.<|im_end|>"},
    )
    text = qwen_tok.decode(rows[0].input_ids)
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    # The row is the whole conversation's render, minus the template's final newline.
    full = qwen_tok.apply_chat_template(
        PLAIN_TWO_TURNS, chat_template=cf.chat_template, tokenize=False
    )
    assert text == full.rstrip("\n")


def test_llama31_date_is_fixed_and_turns_end_with_eot(llama_tok):
    cf = ChatFormat(
        llama_tok, template("meta-llama-Llama-3.1-8B-Instruct"), {"bos_token": "<|begin_of_text|>"}
    )
    rows = cf.encode(PLAIN_TWO_TURNS)
    assert [r.turns for r in rows] == [[1, 3]]
    check_rows(
        cf,
        PLAIN_TWO_TURNS,
        rows,
        {1: "Paris is the capital.<|eot_id|>", 3: "2+2 equals 4.<|eot_id|>"},
    )
    text = llama_tok.decode(rows[0].input_ids)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system")
    assert "Today Date: 26 Jul 2024\n" in text
    assert cf.encode(PLAIN_TWO_TURNS) == rows


def test_strftime_now_renders_a_fixed_date(qwen_tok):
    tpl = (
        "{{ strftime_now('%Y-%m-%d') }}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
    )
    cf = ChatFormat(qwen_tok, tpl)
    assert cf.render(PLAIN_TWO_TURNS[:1]).startswith("2024-07-26<user>")


def test_derived_mask_equals_generation_tag_mask(qwen_tok):
    """On TRL's tagged Qwen3 template, the derived mask is the {% generation %} mask minus the
    newline after <|im_end|> (the tags include it although generation stops at <|im_end|>)."""
    cf = ChatFormat(qwen_tok, template("huggingface-trl-qwen3_training"))
    assert cf.has_generation_tags
    rows = cf.encode(TWO_TURNS)
    assert [r.turns for r in rows] == [[1, 3]]
    check_rows(
        cf,
        TWO_TURNS,
        rows,
        {
            1: "<think>\nA geography question.\n</think>\n\nParis is the capital.<|im_end|>",
            3: "<think>\nSimple arithmetic.\n</think>\n\n2+2 equals 4.<|im_end|>",
        },
    )
    ids, gen_mask = cf.generation_mask(TWO_TURNS)
    newline_after_end = [
        i > 0
        and ids[i - 1] == qwen_tok.convert_tokens_to_ids("<|im_end|>")
        and not qwen_tok.decode([t]).strip()
        for i, t in enumerate(ids)
    ]
    expected = [int(m and not nl) for m, nl in zip(gen_mask, newline_after_end, strict=True)]
    row = rows[0]
    assert ids[: len(row.input_ids)] == row.input_ids
    assert expected[: len(row.input_ids)] == row.loss_mask
    assert sum(expected) == sum(row.loss_mask)


def test_return_assistant_tokens_mask_is_all_zero_without_generation_tags(qwen_tok):
    """Why draftflow derives masks itself: without tags the mask is silently all zero."""
    out = qwen_tok.apply_chat_template(
        TWO_TURNS,
        chat_template=template("Qwen-Qwen3-8B"),
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    assert len(out["input_ids"]) > 0
    assert not any(out["assistant_masks"])
    cf = ChatFormat(qwen_tok, template("Qwen-Qwen3-8B"))
    assert not cf.has_generation_tags
    with pytest.raises(DraftflowError, match="generation"):
        cf.generation_mask(TWO_TURNS)


# -- completions, truncation, non-prefix-stable templates --------------------------------------


def test_target_completions_are_supervised_verbatim(qwen_tok):
    cf = ChatFormat(qwen_tok, template("Qwen-Qwen2.5-7B-Instruct"))
    completions = {i: cf.completion_ids(PLAIN_TWO_TURNS[:i], PLAIN_TWO_TURNS[i]) for i in (1, 3)}
    assert cf.encode(PLAIN_TWO_TURNS, completions) == cf.encode(PLAIN_TWO_TURNS)
    # A non-canonical tokenization of turn 1 cannot be a prefix of turn 3's prompt: a new row.
    split = qwen_tok.encode("P") + qwen_tok.encode("aris is the capital.<|im_end|>")
    assert split != completions[1]
    odd = {1: split, 3: completions[3]}
    rows = cf.encode(PLAIN_TWO_TURNS, odd)
    assert [r.turns for r in rows] == [[1], [3]]
    assert [t for t, m in zip(rows[0].input_ids, rows[0].loss_mask, strict=True) if m] == odd[1]


def test_turns_after_a_missing_completion_are_not_encoded(qwen_tok):
    cf = ChatFormat(qwen_tok, template("Qwen-Qwen2.5-7B-Instruct"))
    c1 = cf.completion_ids(PLAIN_TWO_TURNS[:1], PLAIN_TWO_TURNS[1])
    assert [r.turns for r in cf.encode(PLAIN_TWO_TURNS, {1: c1})] == [[1]]
    assert cf.encode(PLAIN_TWO_TURNS, {3: c1}) == []
    assert cf.encode(PLAIN_TWO_TURNS, {1: [], 3: c1}) == []
    with pytest.raises(ConversationError, match="not assistant turns"):
        cf.encode(PLAIN_TWO_TURNS, {2: c1})


def test_max_length_truncates_and_drops_rows_without_supervision(qwen_tok):
    cf = ChatFormat(qwen_tok, template("Qwen-Qwen2.5-7B-Instruct"))
    (row,) = cf.encode(PLAIN_TWO_TURNS)
    first_end = spans(row.loss_mask)[0][1]
    (cut,) = cf.encode(PLAIN_TWO_TURNS, max_length=first_end + 1)
    assert cut.turns == [1] and cut.input_ids == row.input_ids[: first_end + 1]
    assert cf.encode(PLAIN_TWO_TURNS, max_length=spans(row.loss_mask)[0][0]) == []


def test_template_that_is_not_prefix_stable_needs_target_completions(qwen_tok):
    # DeepSeek-R1 style: the generation prompt opens <think>, the rendered turn does not.
    tpl = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
    )
    cf = ChatFormat(qwen_tok, tpl)
    with pytest.raises(ConversationError, match="not a prefix") as err:
        cf.encode(PLAIN_TWO_TURNS)
    assert "\n" not in str(err.value)
    assert err.value.reason == "needs_completions"
    generated = qwen_tok.encode("ok</think>\n\nParis.<|im_end|>", add_special_tokens=False)
    (row,) = cf.encode(PLAIN_TWO_TURNS[:2], {1: generated})
    assert row.input_ids[: -len(generated)] == cf.prompt_ids(PLAIN_TWO_TURNS[:1])


# -- errors: one line, never a Jinja traceback -------------------------------------------------


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([], "empty"),
        ([{"role": "assistant", "content": "Hi"}], "no user turn"),
        ([{"role": "system", "content": "Be brief."}], "no user turn"),
        ([{"role": "robot", "content": "x"}], "unknown role"),
        ([{"role": "user", "content": None}], "content must be a string"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
            "content must be a string",
        ),
        (["hello"], "not a dict"),
    ],
)
def test_invalid_conversations_raise_one_line_errors(qwen_tok, messages, needle):
    cf = ChatFormat(qwen_tok, template("Qwen-Qwen3-8B"))
    for call in (cf.validate, cf.prompt_ids, cf.encode):
        with pytest.raises(ConversationError, match=needle) as err:
            call(messages)
        assert "\n" not in str(err.value)


def test_user_only_conversation_has_a_prompt_but_nothing_to_encode(qwen_tok):
    cf = ChatFormat(qwen_tok, template("Qwen-Qwen3-8B"))
    user_only = PLAIN_TWO_TURNS[:1]
    assert qwen_tok.decode(cf.prompt_ids(user_only)).endswith("<|im_start|>assistant\n")
    with pytest.raises(ConversationError, match="no assistant turn") as err:
        cf.encode(user_only)
    assert "\n" not in str(err.value)


def test_template_errors_become_one_line_conversation_errors(qwen_tok):
    tpl = "{% if messages|length > 1 %}{{ raise_exception('Roles must\\nalternate') }}{% endif %}x"
    cf = ChatFormat(qwen_tok, tpl)
    with pytest.raises(ConversationError, match="Roles must alternate") as err:
        cf.prompt_ids(PLAIN_TWO_TURNS[:2])
    assert "\n" not in str(err.value)


def test_missing_template_is_reported(qwen_tok):
    tok = copy.copy(qwen_tok)
    tok.chat_template = None
    with pytest.raises(DraftflowError, match="chat_template"):
        ChatFormat(tok)


# -- the tiny offline target --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> ChatFormat:
    from draftflow.config import TinyTargetConfig
    from draftflow.target import build_tiny_target

    ref = build_tiny_target(TinyTargetConfig(), tmp_path_factory.mktemp("tiny"))
    return ChatFormat.from_pretrained(ref.path)


def test_tiny_target_template_gives_one_row_per_multi_turn_conversation(tiny_chat):
    conv = [
        *TWO_TURNS,
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome.", "reasoning_content": None},
    ]
    rows = tiny_chat.encode(conv)
    assert [r.turns for r in rows] == [[1, 3, 5]]
    check_rows(
        tiny_chat,
        conv,
        rows,
        {
            1: "<think>\nA geography question.\n</think>\n\nParis is the capital.<|im_end|>",
            3: "<think>\nSimple arithmetic.\n</think>\n\n2+2 equals 4.<|im_end|>",
            5: "<think>\n\n</think>\n\nYou're welcome.<|im_end|>",
        },
    )


def test_tiny_target_thinking_off_still_one_row(tiny_chat):
    rows = tiny_chat.encode(PLAIN_TWO_TURNS, enable_thinking=False)
    assert [r.turns for r in rows] == [[1, 3]]
    expected = {1: "Paris is the capital.<|im_end|>", 3: "2+2 equals 4.<|im_end|>"}
    check_rows(tiny_chat, PLAIN_TWO_TURNS, rows, expected, enable_thinking=False)
