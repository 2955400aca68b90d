"""Export for serving: vLLM DFlash and speculators configs, names, an exact round trip, and the
vLLM DFlash folder loaded by transformers' AutoModel (trust_remote_code) with the same logits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftflow.compat import rope_theta
from draftflow.config import DrafterConfig
from draftflow.drafters.dflash.config import DFlashConfig
from draftflow.drafters.dflash.export import export_speculators, export_vllm_dflash
from draftflow.drafters.dflash.mask import block_attention_mask
from draftflow.drafters.dflash.model import DFlashDrafter
from draftflow.drafters.registry import load_exported
from draftflow.errors import StoreError
from tests.conftest import MASK_ID

BLOCK = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, target):
    """A saved drafter with non-trivial weights (norms perturbed away from 1)."""
    cfg = DFlashConfig.from_target(target.config, DrafterConfig(num_layers=2, block_size=BLOCK, num_taps=3), MASK_ID)
    torch.manual_seed(3)
    drafter = DFlashDrafter(cfg, target).eval()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.requires_grad and name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("ckpt")
    drafter.save(folder)
    return folder, drafter


def logits(model: DFlashDrafter) -> torch.Tensor:
    """Logits of two blocks over a 12-token context, fixed inputs."""
    g = torch.Generator().manual_seed(0)
    cfg, T = model.config, 12
    anchors = torch.tensor([3, 7])
    pos = anchors[:, None] + torch.arange(BLOCK)[None]
    ids = torch.full_like(pos, MASK_ID)
    ids[:, 0] = torch.randint(0, 299, (2,), generator=g)
    ctx = torch.randn(1, T, cfg.num_taps * cfg.hidden_size, generator=g)
    mask = block_attention_mask(anchors, BLOCK, T)[None]
    with torch.no_grad():
        return model(ids.reshape(1, -1), pos.reshape(1, -1), ctx, torch.arange(T)[None], mask)


def test_vllm_config_has_what_vllm_reads(tmp_path, checkpoint, target):
    out = export_vllm_dflash(checkpoint[0], tmp_path / "vllm", target.config)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [1, 2, 3]}
    assert cfg["block_size"] == BLOCK and cfg["num_target_layers"] == 6
    assert cfg["layer_types"] == ["full_attention"] * 2 and cfg["sliding_window"] is None
    dims = {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                "head_dim", "intermediate_size", "vocab_size")}
    assert dims == dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, intermediate_size=128, vocab_size=320)
    assert cfg["max_position_embeddings"] == target.config.max_position_embeddings
    assert cfg["rope_theta"] == rope_theta(target.config) and cfg["rms_norm_eps"] == target.config.rms_norm_eps


def test_vllm_weights_names_and_no_shared_modules(tmp_path, checkpoint, target):
    out = export_vllm_dflash(checkpoint[0], tmp_path / "vllm", target.config)
    names = set(load_file(str(out / "model.safetensors")))
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    # HF Qwen3 unfused names without a "model." prefix: vLLM adds the prefix and fuses q/k/v itself.
    for leaf in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight"):
        assert f"layers.1.{leaf}" in names
    assert not any(n.startswith("model.") for n in names)
    assert load_file(str(out / "model.safetensors"))["fc.weight"].shape == (64, 3 * 64)


def test_speculators_config(tmp_path, checkpoint, target):
    out = export_speculators(checkpoint[0], tmp_path / "spec", target.config, target_name="org/target")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash"
    assert cfg["aux_hidden_state_layer_ids"] == [2, 3, 4]  # draftflow ids [1, 2, 3] + 1
    assert cfg["mask_token_id"] == MASK_ID and cfg["block_size"] == BLOCK
    spec = cfg["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == BLOCK - 1
    assert spec["verifier"]["name_or_path"] == "org/target"
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 2
    # vLLM's update_dflash maps back with i - 1: the drafter's own ids.
    assert [i - 1 for i in cfg["aux_hidden_state_layer_ids"]] == [1, 2, 3]


@pytest.mark.parametrize("export", [export_vllm_dflash, export_speculators])
def test_round_trip_same_logits(tmp_path, checkpoint, target, export):
    folder, original = checkpoint
    out = export(folder, tmp_path / "out", target.config)
    loaded = load_exported(out, target).eval()
    assert loaded.config.target_layer_ids == original.config.target_layer_ids
    assert loaded.config.mask_token_id == MASK_ID and loaded.config.block_size == BLOCK
    assert torch.equal(logits(loaded), logits(original))


def test_load_exported_refuses_missing_weight(tmp_path, checkpoint, target):
    out = export_vllm_dflash(checkpoint[0], tmp_path / "vllm", target.config)
    weights = load_file(str(out / "model.safetensors"))
    weights.pop("layers.0.self_attn.q_proj.weight")
    save_file(weights, str(out / "model.safetensors"))
    with pytest.raises(StoreError, match="q_proj"):
        load_exported(out, target)


def test_export_refuses_missing_checkpoint(tmp_path, target):
    with pytest.raises(StoreError, match="train a drafter first"):
        export_vllm_dflash(tmp_path / "nothing", tmp_path / "out", target.config)


# ----------------------------------------------------------------------------- transformers AutoModel


def load_with_transformers(out, exported: dict[str, torch.Tensor]):
    """`AutoModel.from_pretrained(out, trust_remote_code=True)`, checked to be the DFlash drafter holding
    exactly the exported weights (transformers silently builds a Qwen3Model without auto_map, and
    silently initialises any weight it does not find)."""
    from transformers import AutoModel

    model, info = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32,
                                            output_loading_info=True)
    assert type(model).__name__ == "DFlashDraftModel", type(model)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    state = model.state_dict()
    assert set(state) == set(exported)
    for name, tensor in exported.items():  # fc and hidden_norm included: loaded, not initialised
        assert torch.equal(state[name], tensor.float()), name
    return model.eval()


def hf_logits(model, target, ids, pos, ctx, mask=None) -> torch.Tensor:
    """Logits of the transformers drafter through the target's LM head (the caller's part)."""
    T = ctx.shape[1]
    with torch.no_grad():
        noise = target.get_input_embeddings()(ids)
        h = model(noise, ctx, torch.cat([torch.arange(T)[None], pos], dim=1), mask)
        return target.lm_head(h)


@pytest.fixture(scope="module")
def sliding_checkpoint(tmp_path_factory, target):
    """A 2-layer drafter whose first layer slides (window 5), norms perturbed."""
    drafter_cfg = DrafterConfig(num_layers=2, block_size=BLOCK, num_taps=3,
                                layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    cfg = DFlashConfig.from_target(target.config, drafter_cfg, MASK_ID)
    torch.manual_seed(4)
    drafter = DFlashDrafter(cfg, target).eval()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.requires_grad and name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("ckpt-sliding")
    drafter.save(folder)
    return folder, drafter


@pytest.mark.parametrize("which", ["checkpoint", "sliding_checkpoint"])
def test_transformers_automodel_loads_the_export_with_the_same_logits(tmp_path, request, target, which):
    folder, original = request.getfixturevalue(which)
    out = export_vllm_dflash(folder, tmp_path / "vllm", target.config)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"} and cfg["model_type"] == "qwen3"
    assert (out / "modeling_dflash.py").is_file()
    model = load_with_transformers(out, load_file(str(out / "model.safetensors")))
    assert model.target_layer_ids == [1, 2, 3] and model.mask_token_id == MASK_ID and model.block_size == BLOCK

    # Two blocks over a 12-token context with draftflow's training mask (anchors 3 and 7).
    g = torch.Generator().manual_seed(0)
    T, anchors = 12, torch.tensor([3, 7])
    pos = (anchors[:, None] + torch.arange(BLOCK)[None]).reshape(1, -1)
    ids = torch.full_like(pos, MASK_ID)
    ids[0, ::BLOCK] = torch.randint(0, 299, (2,), generator=g)
    ctx = torch.randn(1, T, 3 * 64, generator=g)
    mask = block_attention_mask(anchors, BLOCK, T)[None]
    with torch.no_grad():
        want = original(ids, pos, ctx, torch.arange(T)[None], mask)
    torch.testing.assert_close(hf_logits(model, target, ids, pos, ctx, mask), want, rtol=1e-5, atol=1e-5)

    # Inference: one block right after the context, with the model's default mask.
    pos1 = (T + torch.arange(BLOCK))[None]
    ids1 = torch.tensor([[7] + [MASK_ID] * (BLOCK - 1)])
    mask1 = block_attention_mask(torch.tensor([T]), BLOCK, T)[None]  # the anchor follows the whole context
    with torch.no_grad():
        want1 = original(ids1, pos1, ctx, torch.arange(T)[None], mask1)
    torch.testing.assert_close(hf_logits(model, target, ids1, pos1, ctx), want1, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("damage", ["auto_map", "modeling file", "fc weight"])
def test_transformers_check_fails_without_the_modeling_file_auto_map_or_a_weight(tmp_path, checkpoint, target,
                                                                              damage):
    out = export_vllm_dflash(checkpoint[0], tmp_path / "vllm", target.config)
    exported = load_file(str(out / "model.safetensors"))
    if damage == "auto_map":  # transformers then builds a plain Qwen3Model, without an error
        cfg = json.loads((out / "config.json").read_text())
        del cfg["auto_map"]
        (out / "config.json").write_text(json.dumps(cfg))
    elif damage == "modeling file":
        (out / "modeling_dflash.py").unlink()
    else:  # transformers then initialises fc at random, without an error
        save_file({k: v for k, v in exported.items() if k != "fc.weight"}, str(out / "model.safetensors"))
    with pytest.raises((AssertionError, OSError)):
        load_with_transformers(out, exported)
