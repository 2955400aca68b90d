"""vLLM offline engine: every request of a call goes to one `LLM.generate`.

Prompts are the serving prompt ids already rendered with the target's chat
template (`GenRequest.prompt_ids`), submitted as token prompts, so vLLM never
re-applies a template and its continuous batching sees the whole call at once:
that is what reaches vLLM's own offline throughput. Completions follow the
engine contract of `draftflow.engines.base`: ids include the end-of-turn token
when one was produced, text excludes it and is decoded here with the target's
tokenizer exactly as the transformers engine does (special tokens such as
`<think>` kept), which is why vLLM's own detokenization is switched off.

Does not know: conversations, templates, stages or stores; it does not
suppress ids beyond the tokenizer (the transformers engine does) because a
per-request allowed-token mask would cost throughput on real targets, whose
padding rows are trained to be unlikely.

Trade-off: one `generate` per call maximizes throughput but holds the whole
call's outputs in memory and returns nothing until all are done; callers bound
a call by their checkpoint interval. Prompts that leave no room in
`max_model_len` are answered as `prompt_too_long` before submission, because
vLLM rejects them by raising, which would fail the whole call.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from draftflow.compat import importing_transformers
from draftflow.config import VLLMEngineConfig
from draftflow.engines.base import Completion, GenRequest, SamplingParams
from draftflow.errors import ConfigError, DraftflowError

log = logging.getLogger(__name__)

INSTALL_HINT = ("the vllm engine needs vLLM: install the vllm extra (pip install '.[vllm]') on a GPU machine, "
                "or vLLM's CPU build as `make test-vllm` does; or set the engine to hf")
PROMPT_TOO_LONG = "prompt_too_long"
# Head sizes vLLM 0.32's CPU attention backend accepts (vllm/v1/attention/backends/cpu_attn.py,
# `get_supported_head_sizes`); CUDA backends accept more, so the check runs on CPU only.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def import_vllm():
    """Import vLLM lazily (CPU machines never need it).

    Raises:
        DraftflowError: vLLM is not installed, or installed but broken (the message says what to do).
    """
    try:
        import vllm
    except ImportError as exc:
        raise DraftflowError(INSTALL_HINT) from exc
    except Exception as exc:  # e.g. torchvision built for another torch: vLLM imports it eagerly
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DraftflowError(f"vLLM is installed but does not import ({type(exc).__name__}: {first}); on a "
                             "CPU machine uninstall torchvision torchaudio torchcodec (make test-vllm does)") from None
    return vllm


def on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def cpu_threads_bind(setting: str | None) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for `VLLMEngineConfig.cpu_threads_bind`: 'all' as this process's cores
    ("0,1", ...), a list as given, None as None (vLLM chooses)."""
    if setting != "all":
        return setting
    return ",".join(map(str, sorted(os.sched_getaffinity(0))))


_BIND = "VLLM_CPU_OMP_THREADS_BIND"
_bound: dict[str, str] = {}  # the binding this process last set (so a later config without one drops it)


def prepare_environment(vcfg: VLLMEngineConfig) -> None:
    """Environment vLLM reads when its engine starts: its compile cache under draftflow's cache (not the
    user's home) and, on CPU builds, a KV cache of `cpu_kv_cache_gib` (vLLM would size it from RAM) and
    the cores of `cpu_threads_bind` (a binding set outside draftflow is left alone when that is null)."""
    from draftflow.kept import default_cache_dir

    os.environ.setdefault("VLLM_CACHE_ROOT", str(default_cache_dir() / "vllm"))
    if on_cpu():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(vcfg.cpu_kv_cache_gib))
        bind, ours = cpu_threads_bind(vcfg.cpu_threads_bind), _bound.pop(_BIND, None)
        if bind is not None:
            os.environ[_BIND] = _bound[_BIND] = bind
        elif ours is not None and os.environ.get(_BIND) == ours:  # ours, not a binding set since
            del os.environ[_BIND]


def stored_dtype(model_dir: str, dtype: str) -> str:
    """`dtype`, with "auto" read as the dtype the checkpoint is stored in, as transformers reads it.

    vLLM's own "auto" runs float32 checkpoints in half precision (bf16 on CPU), so a float32 target
    would regenerate and capture with other numbers than the transformers engine and training use.
    """
    config_file = os.path.join(model_dir, "config.json")
    if dtype != "auto" or not os.path.isfile(config_file):
        return dtype
    cfg = json.loads(open(config_file).read())
    return str(cfg.get("dtype") or cfg.get("torch_dtype") or "auto")


def eager_mode(vcfg: VLLMEngineConfig) -> bool:
    """Whether draftflow's vLLM engines run eagerly: `enforce_eager`, or where it is null, on CPU builds only."""
    return on_cpu() if vcfg.enforce_eager is None else vcfg.enforce_eager


def engine_kwargs(vcfg: VLLMEngineConfig, model_dir: str, dtype: str) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments every draftflow use shares (generation, capture, serving)."""
    eager = eager_mode(vcfg)
    return {"tensor_parallel_size": vcfg.tensor_parallel_size, "max_model_len": vcfg.max_model_len,
            "gpu_memory_utilization": vcfg.gpu_memory_utilization, "dtype": stored_dtype(model_dir, dtype),
            "seed": 0, "enforce_eager": eager}


def check_head_size(model_dir: str, what: str = "target") -> None:
    """On CPU, refuse a model whose attention head size vLLM's CPU backend does not support, in one line.

    Raises:
        ConfigError: the head size is not in CPU_HEAD_SIZES.
    """
    config_file = os.path.join(model_dir, "config.json")
    if not on_cpu() or not os.path.isfile(config_file):
        return
    cfg = json.loads(open(config_file).read())
    cfg = cfg.get("transformer_layer_config", cfg)  # speculators exports nest the layer config
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if head not in CPU_HEAD_SIZES:
        raise ConfigError(f"the {what} at {model_dir} has attention head size {head}, which vLLM's CPU backend "
                          f"does not support ({', '.join(map(str, CPU_HEAD_SIZES))}); use the hf engine, "
                          "a GPU, or a model with a supported head_dim")


# One vLLM engine per process: it holds most of the accelerator (or the CPU KV cache), so starting
# another (say extract's capture after regenerate's generator) first closes the one before.
_LIVE: dict[tuple, Any] = {}
_LIVE_LOCK = threading.Lock()


def shared_engine(key: tuple, build: Callable[[], Any]) -> Any:
    """The live engine for `key`, built on first use (any other live engine is closed first)."""
    with _LIVE_LOCK:
        if key not in _LIVE:
            release_engines()
            _LIVE[key] = build()
        return _LIVE[key]


def release_engines() -> None:
    """Close every live vLLM engine of this process (frees the GPU before training takes it)."""
    while _LIVE:
        _LIVE.popitem()[1].close()


def forget_engine(engine: Any) -> None:
    """Drop a closed engine from the shared ones, so the next `shared_engine` call starts a new one."""
    for key in [k for k, v in _LIVE.items() if v is engine]:
        del _LIVE[key]


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple, set)) else [int(value)]


def stop_token_ids(generation_eos: Any, tokenizer_eos: int | None) -> list[int]:
    """End-of-turn ids: `generation_config.eos_token_id` (int or list) plus the tokenizer's eos, sorted."""
    return sorted(set(_as_ids(generation_eos)) | set(_as_ids(tokenizer_eos)))


def sampling_kwargs(params: SamplingParams, stop_ids: Sequence[int]) -> dict[str, Any]:
    """Keyword arguments for `vllm.SamplingParams` equivalent to draftflow's `params`.

    temperature 0 is greedy (top-p/top-k/seed then neutral); top_k 0 (disabled)
    becomes -1, which every vLLM version reads as disabled.
    """
    greedy = params.temperature <= 0
    return {
        "max_tokens": params.max_new_tokens,
        "temperature": 0.0 if greedy else params.temperature,
        "top_p": 1.0 if greedy else params.top_p,
        "top_k": -1 if greedy or params.top_k <= 0 else params.top_k,
        "seed": None if greedy else params.seed,  # per request: results do not depend on batching
        "stop_token_ids": list(stop_ids),
    }


def split_by_length(prompts: Sequence[Sequence[int]], max_model_len: int) -> tuple[list[int], list[int]]:
    """Indices of the prompts vLLM can extend by at least one token, and of those it cannot."""
    fits = [i for i, p in enumerate(prompts) if len(p) < max_model_len]
    too_long = [i for i, p in enumerate(prompts) if len(p) >= max_model_len]
    return fits, too_long


def rejected_completion(prompt_tokens: int) -> Completion:
    """The answer to a prompt that does not fit the model's context."""
    return Completion(ids=[], text="", finish_reason=PROMPT_TOO_LONG, prompt_tokens=prompt_tokens)


def to_completion(output: Any, eos_ids: set[int], decode: Callable[[list[int]], str]) -> Completion:
    """Turn a vLLM `RequestOutput` (only its fields are read) into a Completion.

    vLLM keeps a stop token in `token_ids` (it only trims text); if a version
    dropped it, `stop_reason` names it and it is put back, so `ids` always end
    with the end-of-turn token when finish_reason is "stop". Any other ending
    (vLLM's "length", "abort", ...) is "length": the turn is not complete.
    """
    out = output.outputs[0]
    ids = list(out.token_ids)
    if out.finish_reason not in ("stop", "length"):  # e.g. "abort": not a finished turn either way
        log.warning("vLLM finished a request with %r; marked as length", out.finish_reason)
    stopped = out.finish_reason == "stop"
    if stopped and (not ids or ids[-1] not in eos_ids) and isinstance(out.stop_reason, int):
        ids.append(out.stop_reason)
    if stopped and (not ids or ids[-1] not in eos_ids):
        log.warning("vLLM stopped without an end-of-turn token (stop_reason=%r); marked as length", out.stop_reason)
        stopped = False
    body = ids[:-1] if stopped else ids
    return Completion(ids=ids, text=decode(body), finish_reason="stop" if stopped else "length",
                      prompt_tokens=len(output.prompt_token_ids), completion_tokens=len(ids))


def _load_generation_eos(path: str, revision: str | None) -> Any:
    with importing_transformers():
        from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path, revision=revision).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's eos alone
        return None


def _engine_max_len(llm: Any, configured: int | None) -> int:
    """vLLM's resolved context length (from the model config when not configured)."""
    engine = llm.llm_engine
    model_config = getattr(engine, "model_config", None) or engine.vllm_config.model_config
    return int(model_config.max_model_len or configured)


class VLLMEngine:
    name = "vllm"

    def __init__(self, llm: Any, tokenizer: Any, model_id: str, eos_ids: Sequence[int], max_model_len: int):
        self.llm, self.tokenizer, self.model_id = llm, tokenizer, model_id
        self.eos_ids = set(eos_ids)
        self.max_model_len = max_model_len
        self._lock = threading.Lock()  # shard tasks share the engine; vLLM's LLM is not thread-safe

    @classmethod
    def load(cls, path: str, vcfg: VLLMEngineConfig, dtype: str = "auto", revision: str | None = None) -> VLLMEngine:
        """Start vLLM on the target at `path` with the tensor-parallel, context and memory settings of `vcfg`.

        Raises:
            DraftflowError: vLLM is not installed.
            ConfigError: on CPU, the target's head size is not supported.
        """
        vllm = import_vllm()
        check_head_size(path)
        prepare_environment(vcfg)
        with importing_transformers():
            from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
        eos = stop_token_ids(_load_generation_eos(path, revision), tokenizer.eos_token_id)
        llm = vllm.LLM(model=path, revision=revision, **engine_kwargs(vcfg, path, dtype))
        max_len = _engine_max_len(llm, vcfg.max_model_len)
        log.info("vLLM loaded %s (tp=%d, max_model_len=%d, eos=%s)", path, vcfg.tensor_parallel_size, max_len, eos)
        return cls(llm, tokenizer, path, eos, max_len)

    def vllm_sampling(self, params: SamplingParams, detokenize: bool = False):
        """The `vllm.SamplingParams` for `params` (vLLM's text is not used unless `detokenize`)."""
        return import_vllm().SamplingParams(**sampling_kwargs(params, sorted(self.eos_ids)), detokenize=detokenize)

    def generate(self, requests: list[GenRequest], params: SamplingParams) -> list[Completion]:
        """Generate for all requests in one `LLM.generate` call; too-long prompts are answered, not sent."""
        prompts = [r.prompt_ids for r in requests]
        fits, too_long = split_by_length(prompts, self.max_model_len)
        results: list[Completion | None] = [None] * len(requests)
        for i in too_long:
            results[i] = rejected_completion(len(prompts[i]))
        if too_long:
            log.warning("%d of %d prompts exceed max_model_len=%d", len(too_long), len(prompts), self.max_model_len)
        if fits:
            sampling = self.vllm_sampling(params)
            if any(requests[i].seed is not None for i in fits):  # one SamplingParams per request
                sampling = [sampling if requests[i].seed is None else
                            self.vllm_sampling(replace(params, seed=requests[i].seed)) for i in fits]
            with self._lock:
                outputs = self.llm.generate([{"prompt_token_ids": list(prompts[i])} for i in fits],
                                            sampling, use_tqdm=False)
            decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)
            for i, out in zip(fits, outputs):
                results[i] = to_completion(out, self.eos_ids, decode)
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Shut vLLM down and free its GPU memory (the engine is unusable afterwards)."""
        llm, self.llm = self.llm, None
        forget_engine(self)
        shutdown_llm(llm)


def shutdown_llm(llm) -> None:
    """Stop a `vllm.LLM` and free its GPU memory, best effort across vLLM versions (None: nothing)."""
    if llm is None:
        return
    with contextlib.suppress(Exception):  # absent in some vLLM versions
        llm.llm_engine.engine_core.shutdown()
    del llm
    with contextlib.suppress(Exception):
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
