"""Self-instruct: the target writes user prompts from its own user-turn header; they are cleaned, capped,
deduplicated, cached under a key of what decides them, and curated like any prompt file."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from draftflow.chat.format import ChatFormat
from draftflow.config import CurateConfig, RegenerateConfig, SelfInstructConfig, SourceConfig, TargetConfig, load_config
from draftflow.data import dedup, self_instruct
from draftflow.data.schema import read_rows
from draftflow.engines import Completion, GenRequest, SamplingParams
from draftflow.stages import curate
from draftflow.store import Store
from tests.conftest import stamped

CFG = SelfInstructConfig(count=8, max_new_tokens=64, max_chars=60)
# SmolLM2's template: ChatML that adds a default system prompt when the conversation has none.
SMOL = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
        "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _prompts(path: str | Path) -> list[str]:
    return [json.loads(line)["prompt"] for line in Path(path).read_text().splitlines()]


def test_user_header_is_the_template_up_to_the_user_text(tiny_target):
    fmt = ChatFormat.from_pretrained(tiny_target.path)
    assert self_instruct.user_header(fmt, None) == "<|im_start|>user\n"
    smol = ChatFormat(fmt.tokenizer, chat_template=SMOL)
    assert self_instruct.user_header(smol, None) == ("<|im_start|>system\nYou are a helpful AI assistant named "
                                                     "SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\n")
    assert self_instruct.user_header(smol, "Ask.") == "<|im_start|>system\nAsk.<|im_end|>\n<|im_start|>user\n"


def test_clean_strips_drops_caps_and_deduplicates():
    long = " ".join(f"word{i}" for i in range(40))
    done = [Completion([], t, r, 3) for t, r in [
        ("  What is a monad?\n", "stop"), ("   ", "stop"), ("cut off mid", "length"), ("what is  a monad?", "stop"),
        ("What is a monad?", "stop"), ("Say <|im_start|> twice", "stop"), (long, "stop"),
        (long.replace("word39", "word99"), "stop"), ("x" * 50, "stop")]]
    # "what is  a monad?" is a near copy (word n-grams are lower-cased); capped, the two long ones are equal
    assert self_instruct.clean(done, 30, ("<|im_start|>",)) == ["What is a monad?", long[:30].strip(), "x" * 30]
    assert self_instruct.clean(done, 1000)[-3:] == ["Say <|im_start|> twice", long, "x" * 50]  # near copy gone


def test_the_target_writes_clean_prompts_reused_by_key(tiny_target, tmp_path, monkeypatch):
    calls = []
    make = self_instruct.make_engine
    monkeypatch.setattr(self_instruct, "make_engine", lambda *a, **k: calls.append(a[0].engine) or make(*a, **k))
    write = lambda cfg, where: Path(self_instruct.prompts_file(  # noqa: E731
        cfg, tiny_target, TargetConfig(device="cpu"), RegenerateConfig(engine="openai"), where and tmp_path / where))
    first = write(CFG, None)  # the session's cache: the curate test below finds it there
    prompts = _prompts(first)
    assert len(prompts) == 8 and len(set(prompts)) == 8 and calls == ["hf"]  # HTTP engines cannot: hf samples
    assert all(0 < len(p) <= 60 and p == p.strip() for p in prompts)
    sigs = np.frombuffer(b"".join(dedup.signature(p, 3) for p in prompts), "<u4").reshape(8, -1)
    assert not dedup.near_duplicates(sigs, self_instruct.NEAR_DUP)[0].any()
    again = write(CFG, "b")  # another cache: generated again, the same
    assert again.name == first.name and again.read_bytes() == first.read_bytes() and len(calls) == 2
    other = write(CFG.model_copy(update={"seed": 1}), "b")
    assert other.name != first.name and set(_prompts(other)).isdisjoint(prompts) and len(calls) == 3
    assert write(CFG, None) == first and write(CFG, "b") == again and len(calls) == 3  # reused: no engine made


def test_curate_reads_a_self_instruct_source_as_single_user_turns(tiny_target, tmp_path):
    cfg = load_config(None, [f"root={tmp_path}"])
    cfg = cfg.model_copy(update={"curate": CurateConfig(sources=[SourceConfig(name="si", self_instruct=CFG)],
                                                        eval_fraction=0.0)})
    inputs, _ = curate.stage_inputs(cfg)  # generates the file: its key is in curate's fingerprint inputs
    path = cfg.curate.sources[0].generated
    assert path and path.endswith(".jsonl") and Path(path).name in curate.source_keys(cfg.curate)["si"]
    m = curate.run(Store(cfg.root), stamped("curate", "fp", inputs), cfg)
    rows = [r for s in m.shards for r in read_rows(f"{cfg.root}/curate/fp/{s.name}")]
    assert m.rows_out == len(rows) == 8 and m.extra["sources"]["si"]["kept"] == 8
    assert all(len(r["messages"]) == 1 and r["messages"][0]["role"] == "user" for r in rows)
    assert sorted(r["messages"][0]["content"] for r in rows) == sorted(_prompts(path))


def test_vllm_gives_each_seeded_request_its_own_sampling_seed(monkeypatch):
    from draftflow.engines.vllm import VLLMEngine

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kw: kw))
    calls = []
    done = SimpleNamespace(prompt_token_ids=[1], outputs=[SimpleNamespace(token_ids=[5, 9], finish_reason="stop",
                                                                          stop_reason=None)])
    llm = SimpleNamespace(generate=lambda prompts, sampling, use_tqdm: calls.append(sampling) or [done] * len(prompts))
    engine = VLLMEngine(llm, SimpleNamespace(decode=lambda ids, **_: "x"), "m", [9], max_model_len=8)
    engine.generate([GenRequest([], {}, [1], seed=s) for s in (3, None)], SamplingParams(4, 1.0, seed=7))
    engine.generate([GenRequest([], {}, [1])], SamplingParams(4, 1.0, seed=7))
    assert [s["seed"] for s in calls[0]] == [3, 7] and calls[1]["seed"] == 7  # unseeded requests: one params
