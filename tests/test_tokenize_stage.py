"""The tokenize stage around ChatFormat: truncation, minimum supervision, reasons, vocab, workers."""

from collections import Counter
from pathlib import Path

import pytest

from draftflow.config import TokenizeConfig
from draftflow.drafters.eagle3.vocab import draft_vocab
from draftflow.stages.tokenize import encode_parallel, encode_rows, truncate

QWEN3 = str(Path(__file__).parent / "fixtures" / "tokenizers" / "qwen3")


def _row(i, messages, **extra):
    return {"sample_id": f"s{i}", "source": "t", "messages": messages, "generated": None,
            "enable_thinking": False, **extra}


def _chat(turns: int, words: int = 30) -> list[dict]:
    msgs = [{"role": "system", "content": "Be brief."}]
    for t in range(turns):
        msgs += [{"role": "user", "content": f"Question {t}?"},
                 {"role": "assistant", "content": " ".join(["word"] * words) + f" {t}."}]
    return msgs


def test_draft_vocab_maps_top_tokens_in_id_order():
    freq = Counter({50: 9, 7: 9, 3: 1, 99: 5})
    d2t, t2d = draft_vocab(freq, vocab_size=100, n=3)
    used = [i + d for i, d in enumerate(d2t)]
    assert used == [7, 50, 99]  # top-3 by count (ties by id), sorted by id
    assert [t for t, on in enumerate(t2d) if on] == used and len(t2d) == 100
    d2t, t2d = draft_vocab(Counter({5: 2}), vocab_size=10, n=4)  # fewer seen than n: lowest ids fill
    assert [i + d for i, d in enumerate(d2t)] == [0, 1, 2, 5] and sum(t2d) == 4


def test_truncation_reasons():
    assert truncate([1, 2, 3, 4], [0, 0, 1, 1], 2, 1)[2] == "truncated_away"
    assert truncate([1, 2, 3, 4], [0, 0, 1, 1], 3, 2)[2] == "too_few_supervised_tokens"
    ids, mask, why = truncate([1, 2, 3, 4], [0, 0, 1, 1], 4, 2)
    assert why is None and ids == [1, 2, 3, 4] and mask == [0, 0, 1, 1]


def test_every_conversation_is_accounted_for_with_a_reason():
    rows = [
        _row(0, _chat(2)),
        _row(1, [{"role": "user", "content": "only a question"}]),          # nothing to supervise
        _row(2, _chat(1, words=1)),                                          # too short a completion
        _row(3, [{"role": "user", "content": "q"}, {"role": "robot", "content": "x"}]),
    ]
    tcfg = TokenizeConfig(max_length=512, policy="auto", min_supervised_tokens=8)
    res = encode_rows(rows, QWEN3, tcfg, 8)
    kept = {r["sample_id"] for r in res["rows"]}
    assert kept == {"s0"}
    assert sum(res["dropped"].values()) == 3 and len(res["rejects"]) == 3
    reasons = {r["reason"] for r in res["rejects"]}
    assert "too_few_supervised_tokens" in reasons and "no_assistant_turn" in reasons
    assert "unknown_role" in reasons
    assert sum(res["freq"].values()) == sum(sum(r["loss_mask"]) for r in res["rows"])


@pytest.mark.parametrize("policy, rows_per_conversation", [("last_turn", 1), ("per_turn", 3), ("auto", 3)])
def test_policies_shape_the_rows(policy, rows_per_conversation):
    tcfg = TokenizeConfig(max_length=4096, policy=policy, min_supervised_tokens=1)
    res = encode_rows([_row(0, _chat(3))], QWEN3, tcfg, 1)
    assert len(res["rows"]) == rows_per_conversation


def test_all_turns_on_a_template_that_rewrites_history_is_a_counted_reason():
    # Qwen3 renders the last assistant turn with an (empty) think block, earlier ones without:
    # the history is rewritten, so one row cannot supervise every turn as it was generated.
    tcfg = TokenizeConfig(max_length=4096, policy="all_turns", min_supervised_tokens=1)
    res = encode_rows([_row(0, _chat(3))], QWEN3, tcfg, 1)
    assert res["rows"] == [] and res["dropped"] == {"not_prefix_stable": 1}


def test_worker_processes_give_the_same_rows_as_one_process():
    rows = [_row(i, _chat(1 + i % 3)) for i in range(12)]
    tcfg = TokenizeConfig(max_length=4096, policy="auto", min_supervised_tokens=1)
    one = encode_rows(rows, QWEN3, tcfg, 1)
    two = encode_parallel(rows, QWEN3, tcfg.model_copy(update={"num_workers": 2}), 1)
    assert two["rows"] == one["rows"] and two["freq"] == one["freq"]


def test_tools_reach_the_template_and_tool_calls_are_supervised_not_results():
    import json

    from transformers import AutoTokenizer

    params = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                               "parameters": params}}]
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "SUNNY_21C"},
        {"role": "assistant", "content": "It is sunny and 21 degrees in Paris."},
    ]
    tcfg = TokenizeConfig(max_length=4096, policy="per_turn", min_supervised_tokens=1)
    res = encode_rows([_row(0, msgs, tools=json.dumps(tools))], QWEN3, tcfg, 1)
    assert len(res["rows"]) == 2, res["rejects"]
    tok = AutoTokenizer.from_pretrained(QWEN3)
    first, second = res["rows"]
    prompt = tok.decode([t for t, m in zip(first["input_ids"], first["loss_mask"]) if not m])
    supervised = [tok.decode([t for t, m in zip(r["input_ids"], r["loss_mask"]) if m]) for r in res["rows"]]
    assert "get_weather" in prompt and "Weather for a city" in prompt  # the schema was rendered
    assert "<tool_call>" in supervised[0] and '"Paris"' in supervised[0]
    assert "SUNNY_21C" not in supervised[1] and "sunny and 21 degrees" in supervised[1]
