"""Generation engines behind one interface (`Engine.generate`).

`hf` (transformers) runs anywhere; `vllm` (offline, GPU) and `openai`
(OpenAI-compatible HTTP endpoints) import their dependencies lazily inside
their own modules, so CPU machines never need them.
"""

from __future__ import annotations

from draftflow.engines.base import Completion, Engine, GenRequest, SamplingParams

__all__ = ["Completion", "Engine", "GenRequest", "SamplingParams", "make_engine"]


def make_engine(rcfg, target_path: str, dtype: str, device: str, revision: str | None = None) -> Engine:
    """Build the engine named in `regenerate.engine` for the target at `target_path`."""
    if rcfg.engine == "hf":
        from draftflow.engines.hf import HFEngine

        return HFEngine.load(target_path, dtype=dtype, device=device)
    if rcfg.engine == "vllm":  # one per process, shared by the shard tasks (a start costs minutes)
        from draftflow.engines.vllm import VLLMEngine, shared_engine

        key = ("generate", target_path, revision, dtype, rcfg.vllm.model_dump_json())
        return shared_engine(key, lambda: VLLMEngine.load(target_path, rcfg.vllm, dtype=dtype, revision=revision))
    from draftflow.engines.openai import OpenAIEngine

    return OpenAIEngine(rcfg.openai, rcfg.openai.model or target_path)
