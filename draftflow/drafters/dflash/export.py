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

The folder writer, README and names are every kind's (`draftflow.drafters.export`). The vLLM DFlash
folder also carries `modeling_dflash.py` (this folder's, copied) and an `auto_map` naming it, so
`AutoModel.from_pretrained(DIR, trust_remote_code=True)` builds the drafter; `model_type`
stays "qwen3" and `auto_map` names no `AutoConfig`, so vLLM (which picks its DFlash model by
`architectures` and loads the config with Qwen3Config) reads the folder as before.

Trade-off: one rename table shared by both formats and by `load_exported`, so a name vLLM would
not recognise fails the export, not the server.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from draftflow.drafters.dflash.config import DFlashConfig
from draftflow.drafters.dflash.model import SHARED_PREFIXES, DFlashDrafter
from draftflow.drafters.export import (
    EXPORT_FILES,
    KindFiles,
    default_target_name,
    dtype_name,
    rename_tensor,
    renamed,
    write_export,
)
from draftflow.export_readme import serve_entry
from draftflow.layers import engine_layer_id, engine_layer_index
from draftflow.models.weights import WEIGHTS_NAME, load_exact, read_weights_and_config

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
MODELING_NAME = "modeling_dflash.py"
# Only AutoModel: an AutoConfig entry would make vLLM and AutoConfig need trust_remote_code.
AUTO_MAP = {"AutoModel": "modeling_dflash.DFlashDraftModel"}


def modeling_file() -> Path:
    """draftflow's transformers modeling file for DFlash exports (imports only torch and transformers)."""
    from draftflow.drafters.dflash import modeling_dflash  # imported, not only located: code hashes see it

    return Path(modeling_dflash.__file__)


# ----------------------------------------------------------------------------- names


def export_state_dict(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """draftflow names -> exported names, dropping the shared embedding and LM head."""
    own = {k: v for k, v in weights.items() if not k.startswith(SHARED_PREFIXES)}
    return renamed(own, VLLM_NAMES)


def import_state_dict(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Exported names -> draftflow names (the inverse of `export_state_dict`)."""
    back = {dst: src for src, dst in VLLM_NAMES.items()}
    return {rename_tensor(k, back): v for k, v in weights.items()}


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
        "torch_dtype": dtype_name(target_config),
    }


def vllm_config(cfg: DFlashConfig, target_config: Any) -> dict[str, Any]:
    """config.json for vLLM's DFlashDraftModel."""
    return qwen3_dims(cfg, target_config) | {
        "architectures": ["DFlashDraftModel"],
        "auto_map": AUTO_MAP,  # transformers: modeling_dflash.py in the folder; vLLM ignores it
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "target_hidden_size": cfg.hidden_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
    } | serve_entry("dflash", cfg.block_size - 1)


def speculators_config(cfg: DFlashConfig, target_config: Any, verifier: str | None = None) -> dict[str, Any]:
    """config.json in the speculators format (see the module docstring for its source)."""
    verifier = verifier or default_target_name(target_config)
    return {
        "speculators_model_type": "dflash",
        "architectures": ["DFlashSpeculator"],
        "transformer_layer_config": qwen3_dims(cfg, target_config),
        "draft_vocab_size": cfg.vocab_size,  # full target vocabulary: no d2t/t2d tables
        "target_hidden_size": cfg.hidden_size,
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        # Boundary indices (HF hidden_states index): draftflow's "output of layer L" + 1.
        "aux_hidden_state_layer_ids": [engine_layer_index("vllm", i) for i in cfg.target_layer_ids],
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
    config, weights = read_weights_and_config(checkpoint_dir)
    return DFlashConfig.from_dict(config), weights


def _write(out_dir: str | Path, config: dict, weights: dict[str, torch.Tensor], target_name: str,
           served_from: str | None, target_config: Any) -> Path:
    """`write_export` with DFlash's extras: the modeling file and its README section when `auto_map` names it."""
    kind = KindFiles("DFlash")
    if config.get("auto_map"):
        kind = KindFiles("DFlash", {MODELING_NAME: modeling_file().read_bytes()}, tuple(transformers_section(config)))
    return write_export(out_dir, config, export_state_dict(weights), target_name, served_from, target_config, kind)


def export_vllm_dflash(checkpoint_dir: str | Path, out_dir: str | Path, target_config: Any,
                       target_name: str | None = None, served_from: str | None = None) -> Path:
    """Write a folder vLLM serves as a DFlash speculative model (and transformers loads, see `AUTO_MAP`).

    Args:
        checkpoint_dir: a `DFlashDrafter.save` folder (model.safetensors + config.json).
        out_dir: local folder to write (created; files replaced atomically).
        target_config: the target's HF config (max_position_embeddings, torch_dtype).
        target_name: the target's portable name for the README; default from `target_config`.
        served_from: the folder's path or URL for the README's serve line; default `out_dir`.

    Returns:
        `out_dir` as a Path, holding `draftflow.drafters.export.EXPORT_FILES` and `MODELING_NAME`.
    """
    cfg, weights = _read_checkpoint(checkpoint_dir)
    target_name = target_name or default_target_name(target_config)
    return _write(out_dir, vllm_config(cfg, target_config), weights, target_name, served_from, target_config)


def export_speculators(checkpoint_dir: str | Path, out_dir: str | Path, target_config: Any,
                       target_name: str | None = None, served_from: str | None = None) -> Path:
    """Write the drafter in the speculators format (loadable by vLLM and `speculators`).

    Args:
        target_name: the target's portable name (`draftflow.export_readme.portable_target_name`),
            recorded as `verifier.name_or_path`; default from the target config's `_name_or_path`.
        served_from: as for `export_vllm_dflash`.
    """
    cfg, weights = _read_checkpoint(checkpoint_dir)
    target_name = target_name or default_target_name(target_config)
    config = speculators_config(cfg, target_config, target_name)
    return _write(out_dir, config, weights, target_name, served_from, target_config)


# ----------------------------------------------------------------------------- load back


def config_from_export(data: dict[str, Any]) -> DFlashConfig:
    """Rebuild a DFlashConfig from either exported config.json."""
    if data.get("speculators_model_type") == "dflash":
        dims = data["transformer_layer_config"]
        extra = {"block_size": data["block_size"], "mask_token_id": data["mask_token_id"],
                 "target_layer_ids": [engine_layer_id("vllm", i) for i in data["aux_hidden_state_layer_ids"]],
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


def load_exported_dflash(folder: Path, data: dict[str, Any], target_model: torch.nn.Module) -> DFlashDrafter:
    """An exported DFlash folder back as a `DFlashDrafter` (either format)."""
    weights = import_state_dict(load_file(str(folder / WEIGHTS_NAME)))
    return load_exact(DFlashDrafter(config_from_export(data), target_model), weights, folder)


def export_files(fmt: str) -> tuple[str, ...]:
    """The files of an export folder in format `fmt` ("vllm": with the modeling file)."""
    return EXPORT_FILES + ((MODELING_NAME,) if fmt == "vllm" else ())


def transformers_section(config: dict[str, Any]) -> list[str]:
    ids = config["dflash_config"]["target_layer_ids"]
    return [
        "",
        "## Load with transformers",
        "",
        "`modeling_dflash.py` (named by `auto_map`) holds the drafter as a `PreTrainedModel`; pass",
        "`trust_remote_code=True`, or transformers silently builds a plain Qwen3 model instead:",
        "",
        "```python",
        "drafter = AutoModel.from_pretrained(THIS_FOLDER, trust_remote_code=True)",
        "out = target(context_ids, output_hidden_states=True)  # context_ids (B, C)",
        f"taps = torch.cat([out.hidden_states[L + 1] for L in drafter.target_layer_ids], -1)  # {ids}: raw",
        "block = torch.full((B, drafter.block_size), drafter.mask_token_id); block[:, 0] = anchor",
        "pos = torch.arange(C + drafter.block_size).expand(B, -1)  # context, then the block",
        "logits = target.lm_head(drafter(target.get_input_embeddings()(block), taps, pos))",
        "```",
        "",
        "The drafter applies `fc` and `hidden_norm` to the raw tap states itself; slot k of the block",
        "drafts the token at position C + k (slot 0 is the anchor).",
    ]
