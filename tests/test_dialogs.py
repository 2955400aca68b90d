"""Conversation semantics of regeneration: tool results kept or cut, thinking mix, bad turns."""

import json

from draftflow.chat import ChatFormat
from draftflow.config import RegenerateConfig
from draftflow.engines.base import Completion
from draftflow.engines.dialogs import (
    apply_completion,
    calls_match,
    parse_tool_calls,
    plan_dialog,
    thinking_for,
)
from draftflow.engines.hf import HFEngine
from draftflow.stages.regenerate import regenerate_chunk, sampling_params

CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
TOOL_ROW = {"sample_id": "t1", "source": "s", "split": "train", "messages": [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "-3C", "tool_call_id": "c1"},
    {"role": "assistant", "content": "Cold."}]}


class ScriptedEngine:
    """Answers with fixed texts in order: a stand-in for the target's decisions in a test."""

    name, model_id = "scripted", "scripted"

    def __init__(self, texts):
        self.texts = list(texts)

    def generate(self, requests, params):
        return [Completion(None, self.texts.pop(0), "stop", len(r.prompt_ids), 3) for r in requests]


def _chat():
    return ChatFormat.from_pretrained("tests/fixtures/tokenizers/qwen3")


def _run(rows, texts, **cfg):
    rcfg = RegenerateConfig(max_new_tokens=8, **cfg)
    params = sampling_params(rcfg, "tests/fixtures/tokenizers/qwen3")
    return regenerate_chunk(rows, ScriptedEngine(texts), _chat(), rcfg, params, "{}", None)


def test_tool_calls_parse_and_compare():
    text, calls = parse_tool_calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert text == "" and calls_match(calls, [CALL])
    assert not calls_match(calls, [{"function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}])
    assert calls_match([{"function": {"name": "f", "arguments": '{"a": 1, "b": 2}'}}],
                       [{"function": {"name": "f", "arguments": {"b": 2, "a": 1}}}])
    assert parse_tool_calls("plain answer") == ("plain answer", None)


def test_source_tool_result_kept_when_the_regenerated_call_matches():
    call_text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    out, rejects, cut = _run([TOOL_ROW], [call_text, "It is cold."])
    assert not rejects and cut == 0
    roles = [m["role"] for m in out[0]["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert out[0]["messages"][1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert out[0]["messages"][2]["content"] == "-3C" and out[0]["messages"][3]["content"] == "It is cold."


def test_conversation_cut_before_a_tool_result_that_no_longer_applies():
    other = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    out, rejects, cut = _run([TOOL_ROW], [other])
    assert cut == 1 and not rejects
    assert [m["role"] for m in out[0]["messages"]] == ["user", "assistant"]


def test_empty_response_and_length_policy_are_counted_reasons():
    rows = [{"sample_id": f"r{i}", "source": "s", "split": "train",
             "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(2)]
    out, rejects, _ = _run(rows, ["", "fine"])
    assert [r["reason"] for r in rejects] == ["empty_response"] and len(out) == 1
    d = plan_dialog(rows[0])
    d.history.append({"role": "user", "content": "q"})
    apply_completion(d, Completion([1, 2], "cut", "length", 5, 2))
    assert d.generated[0]["finish_reason"] == "length"


def test_thinking_mix_is_a_seeded_fraction():
    rows = [{"sample_id": f"s{i}"} for i in range(2000)]
    share = sum(thinking_for(r, 0.3, 0) for r in rows) / len(rows)
    assert 0.25 < share < 0.35
    assert [thinking_for(r, 0.3, 0) for r in rows] == [thinking_for(r, 0.3, 0) for r in rows]
    assert thinking_for(rows[0], True, 0) is True


def test_sampling_defaults_come_from_generation_config(tmp_path, tiny_target):
    import shutil

    folder = tmp_path / "t"
    shutil.copytree(tiny_target.path, folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    gen.update(do_sample=True, temperature=0.6, top_p=0.95, top_k=20)
    (folder / "generation_config.json").write_text(json.dumps(gen))
    p = sampling_params(RegenerateConfig(), str(folder))
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.95, 20)
    p = sampling_params(RegenerateConfig(temperature=0.0), str(folder))
    assert p.temperature == 0.0
    assert sampling_params(RegenerateConfig(), tiny_target.path).temperature == 0.0  # greedy target
    gen.pop("temperature")  # sampling without a temperature: 1.0 (transformers 5 leaves the field None)
    (folder / "generation_config.json").write_text(json.dumps(gen))
    assert sampling_params(RegenerateConfig(), str(folder)).temperature == 1.0


def test_prompt_longer_than_the_context_is_rejected(tiny_target):
    engine = HFEngine.load(tiny_target.path)
    rcfg = RegenerateConfig(max_new_tokens=4)
    row = {"sample_id": "long", "source": "s", "split": "train",
           "messages": [{"role": "user", "content": "word " * 400}]}
    out, rejects, _ = regenerate_chunk([row], engine, ChatFormat(engine.tokenizer), rcfg,
                                       sampling_params(rcfg, tiny_target.path), "{}", 64)
    assert not out and rejects[0]["reason"] == "prompt_too_long"


def test_a_request_the_server_refuses_fails_only_its_own_conversation():
    from draftflow.errors import DraftflowError

    class Refused(DraftflowError):
        status, index = 400, 1

    class RefusingEngine(ScriptedEngine):
        def generate(self, requests, params):
            if len(requests) == 3:
                raise Refused("http://x/v1/chat/completions: 400 prompt too long")
            return super().generate(requests, params)

    rows = [{"sample_id": f"r{i}", "source": "s", "split": "train",
             "messages": [{"role": "user", "content": "q" * (i + 1)}]} for i in range(3)]
    rcfg = RegenerateConfig(max_new_tokens=8)
    params = sampling_params(rcfg, "tests/fixtures/tokenizers/qwen3")
    out, rejects, _ = regenerate_chunk(rows, RefusingEngine(["a", "b"]), _chat(), rcfg, params, "{}", None)
    assert [r["sample_id"] for r in out] == ["r0", "r2"]
    assert [(r["reason"], r["row"]) for r in rejects] == [("request_rejected", "r1")]


def test_tool_mismatch_policy_drop_counts_the_conversation():
    other = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    out, rejects, cut = _run([TOOL_ROW], [other], tool_mismatch="drop")
    assert not out and cut == 1 and rejects[0]["reason"] == "tool_call_mismatch"
