"""Hidden-state capture with the real vLLM engine equals transformers' `hidden_states[L+1]` at the taps."""

from __future__ import annotations

import pytest
import torch

from draftflow.config import VLLMEngineConfig
from draftflow.engines.capture import capture_in_batches, make_capture_engine
from draftflow.target import load_target
from tests.vllm.conftest import CPU_CONNECTOR

PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 60)), [3] * 17, list(range(100, 300, 3))]


@pytest.fixture(scope="module")
def target_model(tiny_target):
    model, _ = load_target(tiny_target.path, "float32", "cpu")
    return model


@pytest.fixture(scope="module")
def layer_ids(target_model):
    n = target_model.config.num_hidden_layers
    return [0, n // 2, n - 2]  # first, middle, and the last layer a DFlash tap may use


@pytest.fixture(scope="module")
def captured(tiny_target, layer_ids):
    vcfg = VLLMEngineConfig(max_model_len=512, capture_timeout_s=120,
                            hidden_states_connector=None if torch.cuda.is_available() else CPU_CONNECTOR)
    engine = make_capture_engine("vllm", tiny_target.path, layer_ids, "float32", vllm_cfg=vcfg)
    feats, _ = capture_in_batches(engine, PROMPTS, batch_size=3)
    return engine, feats


@torch.no_grad()
def test_features_equal_hf_hidden_states_of_the_next_boundary(captured, target_model, layer_ids):
    _, feats = captured
    for prompt, got in zip(PROMPTS, feats):
        ref = target_model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        assert got.shape == (len(prompt), len(layer_ids), target_model.config.hidden_size)
        for slot, lid in enumerate(layer_ids):
            # bf16 tolerance (the stored dtype); float32 here agrees far closer.
            torch.testing.assert_close(got[:, slot].float(), ref[lid + 1][0], atol=2e-2, rtol=2e-2)
            # ...and the off-by-one neighbour (hidden_states[L], layer L's input) is clearly not it.
            assert (got[:, slot].float() - ref[lid][0]).abs().max() > 1e-2


def test_the_exchange_files_are_removed_after_reading(captured):
    import os

    engine, _ = captured
    assert os.listdir(engine._dir) == [] or all(not f.endswith(".safetensors") for f in os.listdir(engine._dir))
