"""The Qwen3-8B DFlash recipe loads and holds the paper's setup (arXiv 2602.06036)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from draftflow.config import load_config
from draftflow.drafters.dflash.config import DFlashConfig
from draftflow.drafters.dflash.taps import default_dflash_layer_ids

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "qwen3-8b-dflash.yaml"

# Qwen/Qwen3-8B's config.json dims (36 layers, D = 4096, 32 heads / 8 kv heads of 128).
QWEN3_8B = SimpleNamespace(num_hidden_layers=36, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                           head_dim=128, intermediate_size=12288, rms_norm_eps=1e-6, rope_theta=1e6,
                           vocab_size=151936, rope_scaling=None)


def test_recipe_loads_with_the_paper_setup():
    cfg = load_config(RECIPE)
    assert cfg.target.path == "Qwen/Qwen3-8B" and cfg.target.dtype == "bfloat16"
    assert (cfg.drafter.num_layers, cfg.drafter.block_size, cfg.drafter.num_taps) == (5, 16, 5)
    t = cfg.train
    assert (t.epochs, t.lr, t.warmup_ratio, t.grad_clip, t.num_anchors) == (6, 6e-4, 0.04, 1.0, 512)
    assert cfg.tokenize.max_length == 3072 and cfg.regenerate.enable_thinking is False
    assert cfg.regenerate.engine == "vllm" and "cuda" in {cfg.train.device, cfg.target.device}


def test_derived_taps_for_a_36_layer_target():
    cfg = load_config(RECIPE)
    assert default_dflash_layer_ids(36, cfg.drafter.num_taps) == [1, 9, 17, 25, 33]
    dcfg = DFlashConfig.from_target(QWEN3_8B, cfg.drafter, mask_token_id=151669)
    assert dcfg.target_layer_ids == [1, 9, 17, 25, 33]
    assert dcfg.mask_token_id == 151669 and dcfg.num_layers == 5 and dcfg.block_size == 16
