"""The vLLM engine: its pure mappings on CPU with stand-in objects, and (GPU) parity with transformers.

CPU tests never import vLLM: RequestOutput / LLM stand-ins carry only the fields the engine reads.
GPU tests need CUDA and vLLM (`pip install '.[vllm]'`) and are skipped otherwise.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import torch

from draftflow.config import VLLMEngineConfig
from draftflow.engines.base import GenRequest, SamplingParams
from draftflow.engines.vllm import (
    PROMPT_TOO_LONG,
    VLLMEngine,
    import_vllm,
    sampling_kwargs,
    split_by_length,
    stop_token_ids,
    to_completion,
)
from draftflow.errors import DraftflowError

EOS = 7


def fake_output(prompt, token_ids, finish_reason, stop_reason=None):
    """What vLLM's RequestOutput exposes to the engine, and nothing more."""
    out = SimpleNamespace(token_ids=list(token_ids), finish_reason=finish_reason, stop_reason=stop_reason)
    return SimpleNamespace(prompt_token_ids=list(prompt), outputs=[out])


def decode(ids):
    return " ".join(map(str, ids))


# -- pure mappings ---------------------------------------------------------------------------------


@pytest.mark.parametrize("gen, tok, want", [
    ([7, 9], 7, [7, 9]), (9, 7, [7, 9]), (None, 7, [7]), ([3], None, [3]), (None, None, []),
])
def test_stop_token_ids_merge_generation_config_and_tokenizer(gen, tok, want):
    assert stop_token_ids(gen, tok) == want


def test_greedy_sampling_is_neutral_and_unseeded():
    kw = sampling_kwargs(SamplingParams(max_new_tokens=32, temperature=0.0, top_p=0.8, top_k=20, seed=3), [7, 9])
    assert kw == {"max_tokens": 32, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "seed": None,
                  "stop_token_ids": [7, 9]}


@pytest.mark.parametrize("top_k, want", [(0, -1), (20, 20)])
def test_sampling_maps_disabled_top_k_to_minus_one_and_keeps_seed(top_k, want):
    kw = sampling_kwargs(SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=top_k, seed=5), [EOS])
    assert (kw["temperature"], kw["top_p"], kw["top_k"], kw["seed"]) == (0.7, 0.9, want, 5)


def test_split_by_length_leaves_room_for_one_token():
    fits, too_long = split_by_length([[1] * 3, [1] * 4, [1] * 5, [1]], max_model_len=4)
    assert (fits, too_long) == ([0, 3], [1, 2])


def test_stopped_completion_keeps_eos_in_ids_not_in_text():
    c = to_completion(fake_output([1, 2, 3], [4, 5, EOS], "stop"), {EOS}, decode)
    assert (c.ids, c.text, c.finish_reason, c.prompt_tokens, c.completion_tokens) == ([4, 5, EOS], "4 5", "stop", 3, 3)


def test_stop_token_dropped_by_engine_is_put_back():
    c = to_completion(fake_output([1], [4, 5], "stop", stop_reason=EOS), {EOS}, decode)
    assert (c.ids, c.text, c.completion_tokens) == ([4, 5, EOS], "4 5", 3)


def test_length_completion_keeps_every_token_in_text():
    c = to_completion(fake_output([1, 2], [4, 5, 6], "length"), {EOS}, decode)
    assert (c.ids, c.text, c.finish_reason, c.completion_tokens) == ([4, 5, 6], "4 5 6", "length", 3)


def test_aborted_request_is_not_a_finished_turn():
    c = to_completion(fake_output([1], [4], "abort"), {EOS}, decode)
    assert (c.ids, c.text, c.finish_reason) == ([4], "4", "length")


def test_stop_without_end_of_turn_token_is_not_a_finished_turn():
    c = to_completion(fake_output([1], [4, 5], "stop", stop_reason="</s>"), {EOS}, decode)
    assert (c.ids, c.finish_reason) == ([4, 5], "length")


# -- the engine around a stand-in LLM ----------------------------------------------------------------


class FakeLLM:
    """Echoes each prompt's last token, then stops; records every generate call."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, sampling, use_tqdm=True):
        self.calls.append((prompts, sampling))
        return [fake_output(p["prompt_token_ids"], [p["prompt_token_ids"][-1], EOS], "stop") for p in prompts]


@pytest.fixture
def fake_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kw: kw))
    return FakeLLM()


def test_one_generate_call_for_all_fitting_prompts_and_too_long_ones_answered(fake_vllm):
    engine = VLLMEngine(fake_vllm, SimpleNamespace(decode=lambda ids, **_: decode(ids)), "m", [EOS], max_model_len=4)
    prompts = [[1, 2], [1] * 9, [3], [1, 2, 3, 4]]
    out = engine.generate([GenRequest([], {}, p) for p in prompts], SamplingParams(max_new_tokens=4))
    assert len(fake_vllm.calls) == 1
    sent, sampling = fake_vllm.calls[0]
    assert [p["prompt_token_ids"] for p in sent] == [[1, 2], [3]]
    assert sampling["detokenize"] is False and sampling["stop_token_ids"] == [EOS]
    assert [c.finish_reason for c in out] == ["stop", PROMPT_TOO_LONG, "stop", PROMPT_TOO_LONG]
    assert [c.ids for c in out] == [[2, EOS], [], [3, EOS], []]
    assert [c.prompt_tokens for c in out] == [2, 9, 1, 4]


def test_all_prompts_too_long_never_calls_vllm(fake_vllm):
    engine = VLLMEngine(fake_vllm, SimpleNamespace(decode=decode), "m", [EOS], max_model_len=2)
    out = engine.generate([GenRequest([], {}, [1, 2, 3])], SamplingParams(max_new_tokens=4))
    assert fake_vllm.calls == [] and out[0].finish_reason == PROMPT_TOO_LONG


def test_missing_vllm_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(DraftflowError, match=r"pip install '\.\[vllm\]'"):
        import_vllm()
    with pytest.raises(DraftflowError, match="vllm extra"):
        VLLMEngine.load("/nonexistent", VLLMEngineConfig())


def test_completion_text_matches_the_transformers_engine(tiny_target):
    """Fed the ids the transformers engine generated, the mapping reproduces its Completions."""
    from draftflow.engines.hf import HFEngine

    hf = HFEngine.load(tiny_target.path, dtype="float32", device="cpu")
    hf_decode = lambda ids: hf.tokenizer.decode(ids, skip_special_tokens=False)
    prompts = _prompts(tiny_target.path, 3)
    (eos,) = hf.eos_ids
    for p, full in zip(prompts, hf.generate_ids(prompts, SamplingParams(max_new_tokens=12))):
        assert full.finish_reason == "length"  # random weights: the tiny target never ends a turn
        assert to_completion(fake_output(p, full.ids, "length"), hf.eos_ids, hf_decode) == full
        stopped = full.ids[:5] + [eos]  # as vLLM returns a turn that ended: eos kept in token_ids
        assert to_completion(fake_output(p, stopped, "stop"), hf.eos_ids, hf_decode) == \
            hf._completion(stopped, len(p))


def _prompts(path: str, n: int) -> list[list[int]]:
    from draftflow.chat.format import ChatFormat

    chat = ChatFormat.from_pretrained(path)
    return [chat.prompt_ids([{"role": "user", "content": f"Tell me about item {i} and why it matters."}],
                            enable_thinking=False) for i in range(n)]


# -- settings and one-line errors (the real vLLM runs in tests/vllm/, the make test-vllm leg) -----------


def _model_dir(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the head-size check applies to vLLM's CPU build")
def test_unsupported_cpu_head_size_is_one_line_naming_the_model(tmp_path):
    from draftflow.engines.vllm import check_head_size
    from draftflow.errors import ConfigError

    check_head_size(_model_dir(tmp_path, hidden_size=64, num_attention_heads=2, head_dim=32))  # supported
    with pytest.raises(ConfigError, match="head size 16") as err:
        check_head_size(_model_dir(tmp_path, hidden_size=64, num_attention_heads=4, head_dim=16))
    assert str(tmp_path) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="head size 16"):  # no head_dim: hidden / heads
        check_head_size(_model_dir(tmp_path, hidden_size=64, num_attention_heads=4))


def test_auto_dtype_is_the_stored_one_not_vllms_half_precision(tmp_path):
    from draftflow.engines.vllm import stored_dtype

    assert stored_dtype(_model_dir(tmp_path, dtype="float32"), "auto") == "float32"
    assert stored_dtype(_model_dir(tmp_path, torch_dtype="bfloat16"), "auto") == "bfloat16"  # transformers 4
    assert stored_dtype(_model_dir(tmp_path, dtype="float32"), "bfloat16") == "bfloat16"  # explicit wins


@pytest.mark.skipif(torch.cuda.is_available(), reason="the core binding applies to vLLM's CPU build")
def test_cpu_threads_bind_sets_vllms_binding_and_a_config_without_one_drops_it(monkeypatch, tmp_path):
    import os

    from draftflow.engines.vllm import prepare_environment

    monkeypatch.setenv("DRAFTFLOW_CACHE", str(tmp_path))
    for name in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CACHE_ROOT", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(name, raising=False)  # restored after the test
    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    prepare_environment(VLLMEngineConfig(cpu_threads_bind="all"))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == cores
    prepare_environment(VLLMEngineConfig(cpu_threads_bind="0-1"))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    prepare_environment(VLLMEngineConfig())  # null: vLLM's own choice again
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # set outside draftflow: left alone
    prepare_environment(VLLMEngineConfig())
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    with pytest.raises(ValueError, match="cpu_threads_bind"):
        VLLMEngineConfig(cpu_threads_bind="every core")


def test_one_shared_engine_per_process_closes_the_previous_one():
    from draftflow.engines.vllm import forget_engine, release_engines, shared_engine

    class Engine:
        closed = False

        def close(self):
            self.closed = True

    first = shared_engine(("a",), Engine)
    assert shared_engine(("a",), Engine) is first  # built once
    second = shared_engine(("b",), Engine)
    assert first.closed and not second.closed  # a new one frees the memory of the old
    forget_engine(second)
    assert shared_engine(("b",), Engine) is not second
    release_engines()


def test_missing_export_is_one_line(tmp_path):
    from draftflow.engines.vllm_serve import speculative_config
    from draftflow.errors import ConfigError

    with pytest.raises(ConfigError, match="no drafter export at .*run the train stage"):
        speculative_config(tmp_path / "export" / "vllm")


def test_served_tokens_or_tau_that_differ_fail_in_one_line():
    from draftflow.engines.vllm_serve import ServedResult
    from draftflow.errors import LosslessError
    from draftflow.stages.evaluate import ServingMismatch, check_served

    served = ServedResult("x", [[1, 2, 3]], tau=1.5, acceptance_rate=[0.5], drafts=2, accepted=1)
    check_served("vllm", served, [[1, 2, 3]], tau=1.6, tolerance=0.25)  # within tolerance: passes
    with pytest.raises(ServingMismatch, match="tau 1.500 but draftflow measured 2.000") as err:
        check_served("vllm", served, [[1, 2, 3]], tau=2.0, tolerance=0.25)
    assert "\n" not in str(err.value)
    with pytest.raises(LosslessError, match="prompt 0 differs from greedy at generated position 1"):
        check_served("speculators", served, [[1, 9, 3]], tau=1.5, tolerance=0.25)


def test_preflight_names_the_stage_when_vllm_is_missing(monkeypatch, tiny_cfg):
    from draftflow.errors import ConfigError
    from draftflow.runs.plan import check_vllm
    from draftflow.target import resolve_target

    monkeypatch.setitem(sys.modules, "vllm", None)
    tiny_cfg.evaluate.engine = "vllm"
    with pytest.raises(ConfigError, match=r"evaluate\.engine=vllm: the vllm engine needs vLLM"):
        check_vllm(tiny_cfg, resolve_target(tiny_cfg.target))
