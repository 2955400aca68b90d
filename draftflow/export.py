"""Export a trained DFlash drafter for serving: vLLM's native DFlash format and `speculators`.

Both formats hold the drafter's own weights only (no embedding, no LM head: vLLM
shares the target's) in one `model.safetensors` plus a `config.json`:

* **vLLM DFlash** (`export_vllm_dflash`): what `--speculative-config
  '{"method": "dflash", "model": DIR, "num_speculative_tokens": B-1}'` loads. Facts relied on,
  from vLLM `vllm/model_executor/models/qwen3_dflash.py` (DFlashQwen3ForCausalLM):
  `architectures: ["DFlashDraftModel"]` selects that class; the drafter reads
  `dflash_config.mask_token_id` and `dflash_config.target_layer_ids` (0-based "output of
  layer L", the same convention as draftflow), `layer_types` / `sliding_window` per layer
  (sliding layers causal, full layers bidirectional), the Qwen3 dims, and builds `fc` with
  `hidden_size * len(target_layer_ids)` inputs. Its `load_weights` prepends `model.` to
  every name without `lm_head`, fuses `q/k/v_proj -> qkv_proj` and `gate/up_proj ->
  gate_up_proj` itself, and skips `embed_tokens` when the checkpoint has none. So the
  checkpoint keeps HF Qwen3's unfused names without a `model.` prefix: `VLLM_NAMES` below.
* **speculators** (`export_speculators`): vllm-project/speculators'
  `DFlashSpeculatorConfig` (`speculators_model_type: "dflash"`, `transformer_layer_config`,
  `aux_hidden_state_layer_ids`, `mask_token_id`, `block_size`, `draft_vocab_size`,
  `target_hidden_size`) plus `speculators_config` with `proposal_methods[0].speculative_tokens`
  and `verifier.name_or_path`, which vLLM's `SpeculatorsConfig.validate_speculators_config`
  requires. vLLM's `update_dflash` (`transformers_utils/configs/speculators/algos.py`) maps
  `aux_hidden_state_layer_ids` back with `target_layer_ids = [i - 1 for i in aux]`, so
  speculators ids are boundary indices: draftflow id + 1.

What it does not know: training, stores (it writes a local folder; the train stage copies
it into the artifact store), EAGLE-3. Trade-off: one rename table shared by both formats and
by `load_exported`, so a name vLLM would not recognise fails the export, not the server.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from draftflow.errors import StoreError
from draftflow.models.dflash import (
    CONFIG_NAME,
    SHARED_PREFIXES,
    WEIGHTS_NAME,
    DFlashConfig,
    DFlashDrafter,
    write_weights_and_config,
)

# draftflow parameter-name prefix -> exported (vLLM / speculators) prefix. Every exported
# tensor must match one entry; the shared embedding and LM head are never exported.
VLLM_NAMES: dict[str, str] = {
    "layers.": "layers.",  # layers.N.{self_attn.{q,k,v,o}_proj,q_norm,k_norm},mlp.*,*_layernorm}
    "fc.": "fc.",  # (D, n_taps*D), no bias
    "hidden_norm.": "hidden_norm.",
    "norm.": "norm.",
}
# Exported config keys -> DFlashConfig fields (the dims shared by both formats).
CONFIG_FIELDS: dict[str, str] = {
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "intermediate_size": "intermediate_size",
    "rms_norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "vocab_size": "vocab_size",
}
EXPORT_FILES = (CONFIG_NAME, WEIGHTS_NAME)


# ----------------------------------------------------------------------------- names


def _rename(name: str, table: dict[str, str]) -> str:
    for src, dst in table.items():
        if name.startswith(src):
            return dst + name[len(src):]
    raise StoreError(f"parameter {name!r} has no entry in draftflow.export.VLLM_NAMES; add one")


def export_state_dict(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """draftflow names -> exported names, dropping the shared embedding and LM head."""
    own = {k: v for k, v in weights.items() if not k.startswith(SHARED_PREFIXES)}
    return {_rename(k, VLLM_NAMES): v.detach().cpu().contiguous() for k, v in own.items()}


def import_state_dict(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Exported names -> draftflow names (the inverse of `export_state_dict`)."""
    back = {dst: src for src, dst in VLLM_NAMES.items()}
    return {_rename(k, back): v for k, v in weights.items()}


# ----------------------------------------------------------------------------- configs


def _layer_attention(cfg: DFlashConfig) -> tuple[list[str], int | None]:
    # Sliding-window layers may be added to DFlashConfig; until then every layer is full attention.
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_layers
    return list(layer_types), getattr(cfg, "sliding_window", None)


def qwen3_dims(cfg: DFlashConfig, target_config: Any) -> dict[str, Any]:
    """The drafter as a Qwen3 config: dims, attention layout, and what vLLM's Qwen3 layers read."""
    layer_types, window = _layer_attention(cfg)
    dims = {key: getattr(cfg, f) for key, f in CONFIG_FIELDS.items()}
    return dims | {
        "model_type": "qwen3",
        "hidden_act": "silu",  # MLP is SwiGLU
        "attention_bias": False,
        "tie_word_embeddings": False,
        "rope_scaling": None,  # the drafter uses plain RoPE (DFlashConfig.from_target warns)
        "max_position_embeddings": int(getattr(target_config, "max_position_embeddings", 32768)),
        "layer_types": layer_types,
        "sliding_window": window,
        "use_sliding_window": window is not None,
        "torch_dtype": _dtype_name(target_config),
    }


def _dtype_name(target_config: Any) -> str:
    dtype = getattr(target_config, "torch_dtype", None) or "bfloat16"
    return str(dtype).removeprefix("torch.")


def vllm_config(cfg: DFlashConfig, target_config: Any) -> dict[str, Any]:
    """config.json for vLLM's DFlashDraftModel."""
    return qwen3_dims(cfg, target_config) | {
        "architectures": ["DFlashDraftModel"],
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "target_hidden_size": cfg.hidden_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
    }


def speculators_config(cfg: DFlashConfig, target_config: Any, verifier: str | None = None) -> dict[str, Any]:
    """config.json in the speculators format (see the module docstring for its source)."""
    verifier = verifier or getattr(target_config, "_name_or_path", None) or "target"
    return {
        "speculators_model_type": "dflash",
        "architectures": ["DFlashSpeculator"],
        "transformer_layer_config": qwen3_dims(cfg, target_config),
        "draft_vocab_size": cfg.vocab_size,  # full target vocabulary: no d2t/t2d tables
        "target_hidden_size": cfg.hidden_size,
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        # Boundary indices (HF hidden_states index): draftflow's "output of layer L" + 1.
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size - 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier,
                         "architectures": list(getattr(target_config, "architectures", None) or [])},
        },
    }


# ----------------------------------------------------------------------------- export


def _read_checkpoint(checkpoint_dir: str | Path) -> tuple[DFlashConfig, dict[str, torch.Tensor]]:
    folder = Path(checkpoint_dir)
    if not (folder / CONFIG_NAME).is_file() or not (folder / WEIGHTS_NAME).is_file():
        raise StoreError(f"{folder} has no {CONFIG_NAME} + {WEIGHTS_NAME}; train a drafter first")
    cfg = DFlashConfig.from_dict(json.loads((folder / CONFIG_NAME).read_text()))
    return cfg, load_file(str(folder / WEIGHTS_NAME))


def _write(out_dir: str | Path, config: dict, weights: dict[str, torch.Tensor]) -> Path:
    return write_weights_and_config(out_dir, export_state_dict(weights), config)


def export_vllm_dflash(checkpoint_dir: str | Path, out_dir: str | Path, target_config: Any) -> Path:
    """Write a folder vLLM serves as a DFlash speculative model.

    Args:
        checkpoint_dir: a `DFlashDrafter.save` folder (model.safetensors + config.json).
        out_dir: local folder to write (created; files replaced atomically).
        target_config: the target's HF config (max_position_embeddings, torch_dtype).

    Returns:
        `out_dir` as a Path, holding `EXPORT_FILES`.
    """
    cfg, weights = _read_checkpoint(checkpoint_dir)
    return _write(out_dir, vllm_config(cfg, target_config), weights)


def export_speculators(checkpoint_dir: str | Path, out_dir: str | Path, target_config: Any,
                       verifier: str | None = None) -> Path:
    """Write the drafter in the speculators format (loadable by vLLM and `speculators`).

    Args:
        verifier: the target's name or path recorded as the verifier; default: the
            target config's `_name_or_path`.
    """
    cfg, weights = _read_checkpoint(checkpoint_dir)
    config = speculators_config(cfg, target_config, verifier)
    return _write(out_dir, config, weights)


# ----------------------------------------------------------------------------- load back


def config_from_export(data: dict[str, Any]) -> DFlashConfig:
    """Rebuild a DFlashConfig from either exported config.json."""
    if data.get("speculators_model_type") == "dflash":
        dims = data["transformer_layer_config"]
        extra = {"block_size": data["block_size"], "mask_token_id": data["mask_token_id"],
                 "target_layer_ids": [i - 1 for i in data["aux_hidden_state_layer_ids"]],
                 "num_target_layers": data.get("num_target_layers")}
    else:
        dims, dflash = data, data["dflash_config"]
        extra = {"block_size": data["block_size"], "mask_token_id": dflash["mask_token_id"],
                 "target_layer_ids": list(dflash["target_layer_ids"]),
                 "num_target_layers": data["num_target_layers"]}
    known = {f.name for f in fields(DFlashConfig)}
    values = {f: dims[key] for key, f in CONFIG_FIELDS.items()} | extra
    values |= {k: dims[k] for k in ("layer_types", "sliding_window") if k in known and k in dims}
    if values["num_target_layers"] is None:  # speculators does not record it; any valid bound
        values["num_target_layers"] = max(values["target_layer_ids"]) + 1
    return DFlashConfig.from_dict(values)


def load_exported(export_dir: str | Path, target_model: torch.nn.Module) -> DFlashDrafter:
    """Load an exported folder back into a `DFlashDrafter` around `target_model` (round-trip check).

    Raises:
        StoreError: missing files, or exported weights that do not match the config exactly.
    """
    folder = Path(export_dir)
    cfg = config_from_export(json.loads((folder / CONFIG_NAME).read_text()))
    weights = import_state_dict(load_file(str(folder / WEIGHTS_NAME)))
    model = DFlashDrafter(cfg, target_model)
    expected = set(model.trainable_state_dict())
    if set(weights) != expected:
        raise StoreError(f"{folder} weights do not match its config: missing {sorted(expected - set(weights))[:5]}, "
                         f"unexpected {sorted(set(weights) - expected)[:5]}")
    model.load_state_dict(weights, strict=False)
    return model
