"""The fast tokenize path gives exactly the reference path's rows (issue 16, point 3).

`ChatFormat(fast=True)` (the default) renders through `_ChatSandbox` and tokenizes through the
tokenizer's Rust backend, texts cut after added tokens and each distinct piece tokenized once;
`ChatFormat(fast=False)` renders in Jinja's ImmutableSandboxedEnvironment and tokenizes through
`tokenizer(texts)`, as transformers does. For every template in tests/fixtures/chat_templates,
every conversation case, synthetic benchmark conversations and every policy (with ids derived from
the template and with the target's ids handed over), both give the same rows (input_ids, loss_mask,
turns, spans) or the same reason code. The sandbox's shortcuts are also checked against templates
that poke at what the sandbox forbids, and the cut rule against tokenizers where cutting would
change the ids (overlapping or whitespace-taking tokens, Metaspace).
"""

from __future__ import annotations

import copy
import functools
import random

import pytest
from tokenizers import AddedToken

from benchmarks.tokenize import conversation
from draftflow.chat import POLICIES, ChatFormat, EncodeRequest
from draftflow.chat.render import compile_template
from draftflow.chat.tokens import cut_pattern, fast_backend, tokenize_texts
from draftflow.errors import ConversationError
from draftflow.stages.tokenize import count_supervised
from tests.test_chat_cases import CASES, SPECIAL_KWARGS, TEMPLATE_NAMES, TEMPLATES, case, chat_format, qwen_tokenizer


@functools.cache
def reference(name: str) -> ChatFormat:
    fast = chat_format(name)
    text = (TEMPLATES / f"{name}.jinja").read_text()
    return ChatFormat(fast.tokenizer, text, dict(SPECIAL_KWARGS.get(name, {})), name=name, fast=False)


def _synthetic(n: int) -> list[tuple[list[dict], dict]]:
    rng = random.Random(16)
    return [(conversation(rng, i)["messages"], {"enable_thinking": True}) for i in range(n)]


def _outcomes(chat: ChatFormat, requests: list[EncodeRequest], policy: str) -> list[object]:
    out = chat.encode_many(requests, policy=policy)
    return [r.reason if isinstance(r, ConversationError) else r for r in out]


def _completions(chat: ChatFormat, messages: list[dict], kw: dict) -> dict[int, list[int]]:
    """Ids per turn as regenerate hands them over: derived once by the reference, or (templates
    that cannot derive them) the ids of the message's text, which are supervised verbatim."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    try:
        return {i: chat.completion_ids(messages[:i], messages[i], **kw) for i in turns}
    except ConversationError:
        return {i: chat.tokenize([messages[i]["content"] or "call"])[0] for i in turns}


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_fast_path_equals_reference_path_on_every_template(name):
    fast, ref = chat_format(name), reference(name)
    assert fast.fast and not ref.fast
    convs = [case(c, name) for c in CASES] + _synthetic(3)
    derived = [EncodeRequest(m, None, kw) for m, kw in convs]
    given = [EncodeRequest(m, _completions(ref, m, kw), kw) for m, kw in convs]
    compared = 0
    for policy in POLICIES:
        for requests in (derived, given):
            want = _outcomes(ref, requests, policy)
            assert _outcomes(fast, requests, policy) == want, policy
            compared += sum(not isinstance(w, str) for w in want)
    assert compared  # at least some rows were built and compared, not only errors
    assert fast.is_prefix_stable() == ref.is_prefix_stable()


def test_backend_is_bypassed_when_its_state_differs_from_what_transformers_sets():
    tok = copy.deepcopy(qwen_tokenizer())
    texts = ["<|im_start|>user\nHello there, how are you?<|im_end|>\n", "x" * 50]
    want = [list(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]
    assert fast_backend(tok) is not None
    assert tokenize_texts(tok, texts) == tokenize_texts(tok, texts, direct=False) == want
    tok.backend_tokenizer.enable_truncation(max_length=4)  # transformers turns this off per call
    assert fast_backend(tok) is None
    assert tokenize_texts(tok, texts) == want
    assert tokenize_texts(tok, []) == []


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages[0].__class__ }}",
        "{{ messages[0].clear() }}",
        "{{ messages.append(1) }}",
        "{{ messages[0].content.format(1) }}",
        "{{ 'a{0}'.format(messages[0].role) }}",
        "{{ messages[0].content.__len__() }}",
        "{{ messages[0].items() | list }}",
        "{{ messages[0].missing is defined }}{{ messages[0].role }}",
        "{% set ns = namespace(a=1, f=messages[0].content.upper) %}{{ ns.a }}{{ ns.f() }}{{ ns._x }}",
        "{% for m in messages %}{{ loop.index0 }}{{ loop.last }}{{ loop.cycle('x', 'y') }}"
        "{{ loop._after }}{% endfor %}",
    ],
)
def test_sandbox_shortcuts_answer_as_the_sandbox_does(template):
    messages = [{"role": "user", "content": "hi {0}"}, {"role": "assistant", "content": "ok"}]

    def render(fast: bool) -> str:
        try:
            return compile_template(template, fast).render(messages=messages)
        except Exception as exc:  # noqa: BLE001 - whatever the sandbox raises, both must raise it
            return f"{type(exc).__name__}: {exc}"

    assert render(True) == render(False)


def test_supervised_counts_by_runs_equal_counts_by_token():
    from collections import Counter

    ids, mask = [5, 6, 7, 8, 9, 5, 6], [0, 1, 1, 0, 1, 1, 1]
    freq: Counter = Counter()
    count_supervised(freq, ids, mask)
    assert freq == Counter(t for t, m in zip(ids, mask, strict=True) if m)
    count_supervised(freq, [1, 2], [0, 0])
    assert sum(freq.values()) == 5


BOUNDARIES = [
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|im_end|>\n\nfoo<|im_end|><|im_start|>  x<think>\n\n</think>\n\n bar",
    "\n\n<|im_end|>",
    "<|im_end|>",
    "",
    "plain text with no marker",
]


def test_texts_cut_after_added_tokens_give_transformers_ids():
    tok = copy.deepcopy(qwen_tokenizer())
    backend = fast_backend(tok)
    pattern = cut_pattern(backend)
    assert pattern is not None and pattern.fullmatch("<|im_end|>") and pattern.fullmatch("<|im_start|>")
    want = [list(ids) for ids in tok(BOUNDARIES, add_special_tokens=False)["input_ids"]]
    assert tokenize_texts(tok, BOUNDARIES) == want
    assert tokenize_texts(tok, BOUNDARIES[:1] * 3) == want[:1] * 3  # repeated pieces share their ids


def test_no_cut_at_tokens_whose_match_depends_on_their_neighbours():
    """A token that another added token contains, or one that takes the whitespace after it, is no cut."""
    tok = copy.deepcopy(qwen_tokenizer())
    tok.add_tokens(
        [
            AddedToken("<|im_end|>\n", special=True, normalized=False),
            AddedToken("<glue>", rstrip=True, normalized=False),
        ]
    )
    pattern = cut_pattern(fast_backend(tok))
    assert pattern is not None and pattern.fullmatch("<|im_start|>")
    assert not pattern.fullmatch("<|im_end|>") and not pattern.fullmatch("<glue>")
    texts = [*BOUNDARIES, "<glue>  after<|im_end|>\nx<|im_end|>y"]
    want = [list(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]
    assert tokenize_texts(tok, texts) == want


def test_no_cuts_with_a_pre_tokenizer_that_looks_at_offsets():
    """Metaspace (prepend_scheme first) treats a text's first piece apart: cutting would change ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "▁a": 1, "a": 2, "▁b": 3, "b": 4, "<e>": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    tok.add_tokens([AddedToken("<e>", special=True, normalized=False)])
    assert fast_backend(tok) is not None and cut_pattern(fast_backend(tok)) is None
    texts = ["a<e>b", "b"]
    assert tokenize_texts(tok, texts) == [list(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]
