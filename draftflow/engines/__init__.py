"""Generation engines behind one interface (`Engine.generate`).

`hf` (transformers) runs anywhere; later engines (vLLM offline, OpenAI-compatible
HTTP) import their heavy dependencies lazily inside their own module.
"""

from draftflow.engines.base import Completion, Engine, SamplingParams

__all__ = ["Completion", "Engine", "SamplingParams", "make_engine"]


def make_engine(name: str, model_path: str, dtype: str, device: str) -> Engine:
    """Build the engine named in `regenerate.engine`."""
    if name == "hf":
        from draftflow.engines.hf import HFEngine

        return HFEngine.load(model_path, dtype=dtype, device=device)
    from draftflow.errors import ConfigError

    raise ConfigError(f"regenerate.engine '{name}' is not available; use 'hf'")
