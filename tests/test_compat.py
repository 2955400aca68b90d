"""transformers 4 / 5 config reads: the same answers from either version's config shape."""

from types import SimpleNamespace

import pytest

from draftflow.compat import config_dtype, quiet_progress, rope_scaling, rope_theta

V4_PLAIN = SimpleNamespace(rope_theta=1e6, rope_scaling=None)
V5_PLAIN = SimpleNamespace(rope_parameters={"rope_theta": 1e6, "rope_type": "default"})
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
V4_YARN = SimpleNamespace(rope_theta=1e6, rope_scaling=dict(YARN))
V5_YARN = SimpleNamespace(rope_parameters={**YARN, "rope_theta": 1e6})
# Gemma 3 in transformers 5: one RoPE per layer type; 4.x kept the full-attention base in rope_theta.
V5_PER_LAYER = SimpleNamespace(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                "full_attention": {"rope_type": "default", "rope_theta": 1e6}})


@pytest.mark.parametrize("config", [V4_PLAIN, V5_PLAIN, V4_YARN, V5_YARN, V5_PER_LAYER])
def test_rope_theta_reads_either_shape(config):
    assert rope_theta(config) == 1e6


def test_rope_theta_defaults_only_when_absent():
    assert rope_theta(SimpleNamespace()) == 10000.0


def test_rope_scaling_is_none_for_plain_rope_in_both_shapes():
    assert rope_scaling(V4_PLAIN) is None and rope_scaling(V5_PLAIN) is None and rope_scaling(V5_PER_LAYER) is None
    assert rope_scaling(V4_YARN) == YARN == rope_scaling(V5_YARN)


def test_config_dtype_prefers_dtype_over_torch_dtype():
    assert config_dtype(SimpleNamespace(dtype="bfloat16", torch_dtype="float32")) == "bfloat16"
    assert config_dtype(SimpleNamespace(torch_dtype="float16")) == "float16"
    assert config_dtype(SimpleNamespace()) is None


def test_installed_qwen3_config(target):
    """The real config of the installed transformers (4.x: rope_theta; 5.x: rope_parameters)."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(rope_theta=5e5, dtype="bfloat16")
    assert rope_theta(cfg) == 5e5 and rope_scaling(cfg) is None
    assert str(config_dtype(cfg)).removeprefix("torch.") == "bfloat16"
    assert rope_theta(target.config) == 10000.0


def test_quiet_progress_restores_the_setting():
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    with quiet_progress():
        assert not hf_logging.is_progress_bar_enabled()
    assert hf_logging.is_progress_bar_enabled() == was


def test_drafter_configs_take_the_targets_rope_base_and_do_not_warn(caplog):
    """transformers 5 has no `config.rope_theta`: a getattr default would silently train with 10000."""
    from transformers import Qwen3Config

    from draftflow.config import DrafterConfig
    from draftflow.drafters.dflash.config import DFlashConfig
    from draftflow.drafters.eagle3.config import Eagle3Config

    cfg = Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=12,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=5e5)
    with caplog.at_level("WARNING"):
        dflash = DFlashConfig.from_target(cfg, DrafterConfig(num_layers=1, block_size=4, num_taps=3), 300)
    assert dflash.rope_theta == 5e5 and "rope_scaling" not in caplog.text  # plain RoPE is not "scaling"
    assert Eagle3Config.from_target(cfg, DrafterConfig(kind="eagle3"), 64).rope_theta == 5e5
