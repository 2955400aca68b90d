"""Every source adapter on small fixtures written in the real formats (tests/fixtures/sources)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftflow.config import SourceConfig
from draftflow.data.readers import read_file, source_files
from draftflow.data.schema import from_stored, sample_id, to_stored
from draftflow.data.sources import BadRow, detect, to_conversation

FIX = Path(__file__).parent / "fixtures" / "sources"


def convert(name: str, fmt: str = "auto", columns: dict | None = None) -> list:
    """(messages, tools) or the BadRow reason, for every row of a fixture."""
    out = []
    for raw in read_file(str(FIX / name)):
        try:
            if isinstance(raw, BadRow):
                raise raw
            out.append(to_conversation(raw, fmt, columns))
        except BadRow as bad:
            out.append(bad.reason)
    return out


def test_sharegpt_roles_system_column_and_unknown_role():
    rows = convert("sharegpt.jsonl")
    assert [m["role"] for m in rows[1][0]] == ["system", "user", "assistant", "user", "assistant"]
    assert rows[2][0][0] == {"role": "system", "content": "Answer in French.", "reasoning_content": None}
    assert rows[3] == "unknown_role"


def test_sharegpt_parts_that_open_with_an_answer_lose_it_and_a_chat_of_answers_only_is_rejected():
    """ShareGPT V3 splits long chats; a part that starts mid-chat opens with a `gpt` turn (39% of its records)."""
    from draftflow.data.sources import from_sharegpt

    part = {"system": "Be brief.", "conversations": [{"from": "gpt", "value": "...and so on."},
            {"from": "human", "value": "Go on."}, {"from": "gpt", "value": "Done."}]}
    assert [(m["role"], m["content"]) for m in from_sharegpt(part)] == [
        ("system", "Be brief."), ("user", "Go on."), ("assistant", "Done.")]
    with pytest.raises(BadRow) as bad:
        from_sharegpt({"conversations": [{"from": "gpt", "value": "An answer to nothing."}]})
    assert bad.value.reason == "no_user_turn"


def test_openai_tool_calls_reasoning_tools_and_content_parts():
    rows = convert("openai_tools.jsonl")
    messages, tools = rows[0]
    call = messages[2]
    assert call["content"] == "" and call["reasoning_content"] == "Need the tool."
    assert call["tool_calls"] == [{"id": "call_1", "type": "function",
                                   "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert messages[3]["tool_call_id"] == "call_1" and messages[3]["name"] == "get_weather"
    assert json.loads(tools)[0]["function"]["name"] == "get_weather"
    assert rows[1][0][0]["role"] == "system" and rows[1][0][1]["content"] == "Describe\na cat."  # developer, parts
    assert rows[2] == "non_text_content" and rows[3] == "unknown_role"
    assert rows[4][1] == tools  # tools given as a JSON string, stored canonically


def test_tool_calls_round_trip_through_the_stored_form():
    messages, _ = convert("openai_tools.jsonl")[0]
    stored = to_stored(messages)
    assert isinstance(stored[2]["tool_calls"], str)
    assert from_stored([{**m, **{k: m.get(k) for k in ("tool_calls", "tool_call_id", "name")}} for m in stored]) \
        == messages


def test_alpaca_openorca_magicoder_prompt_and_function_calling():
    alpaca = convert("evol_codealpaca.parquet")
    assert alpaca[0][0][0] == {"role": "user", "content": "Write a function that reverses a string.",
                               "reasoning_content": None}
    orca = convert("openorca.parquet")
    assert [m["role"] for m in orca[0][0]] == ["system", "user", "assistant"]
    assert [m["role"] for m in orca[1][0]] == ["user", "assistant"]  # empty system_prompt dropped
    magic = convert("magicoder.jsonl.gz")
    assert magic[1][0][0]["content"].startswith("Write a Rust function")
    prompts = convert("prompts.jsonl.zst")
    assert [m["role"] for m in prompts[2][0]] == ["system", "user"] and len(prompts[0][0]) == 1
    xlam = convert("xlam.jsonl")
    messages, tools = xlam[0]
    assert [c["function"]["arguments"] for c in messages[1]["tool_calls"]] == [{"type": "beta"}, {"type": "game"}]
    assert json.loads(tools)[0]["name"] == "live_giveaways_by_type"
    assert xlam[1] == "malformed_json"  # a truncated answers string


def test_detection_and_column_mapping():
    assert [detect(r) for r in ({"conversations": []}, {"messages": []}, {"instruction": ""}, {"question": ""},
                                {"problem": ""}, {"query": "", "tools": ""}, {"prompt": ""})] == [
        "sharegpt", "openai", "alpaca", "openorca", "magicoder", "function_calling", "prompt"]
    rows = convert("broken.jsonl", columns={"prompt": "text"})
    assert rows[-1][0][0]["content"] == "no known columns"


def test_bad_input_gets_reason_codes():
    assert convert("broken.jsonl")[1:] == ["malformed_json", "invalid_utf8", "not_an_object", "invalid_utf8",
                                           "unknown_format"]
    assert convert("broken.jsonl", fmt="alpaca")[0] == "missing_columns"


def test_sample_ids_ignore_missing_tool_calls():
    plain = [{"role": "user", "content": "hi", "reasoning_content": None}]
    assert sample_id("s", plain) == sample_id("s", [{"role": "user", "content": "hi"}])
    with_call = [{"role": "user", "content": "hi", "tool_calls": [{"function": {"name": "f"}}]}]
    assert sample_id("s", with_call) != sample_id("s", plain)


def test_globs_expand_sorted_and_missing_paths_fail(tmp_path):
    from draftflow.errors import SourceError

    files = source_files(SourceConfig(name="x", path=str(FIX / "*.jsonl")))
    assert [Path(f).name for f in files] == ["broken.jsonl", "openai_tools.jsonl", "sharegpt.jsonl", "xlam.jsonl"]
    with pytest.raises(SourceError, match="source 'y': path .*nope-\\*.jsonl does not exist"):
        source_files(SourceConfig(name="y", path=str(tmp_path / "nope-*.jsonl")))
