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

EAGLE-3 (`draftflow.export_eagle3`: `export_eagle3_vllm`, `export_eagle3_speculators`; and
`load_exported` for any export), the drafter's own weights plus
the `d2t` (int64, draft id -> target id offset) and `t2d` (bool over the target vocabulary)
tensors, no embedding, no target LM head:

* **vLLM native EAGLE-3**: what `--speculative-config '{"method": "eagle3", "model": DIR,
  "num_speculative_tokens": K}'` loads. Verified in vLLM `vllm/model_executor/models/registry.py`
  (`"LlamaForCausalLMEagle3": ("llama_eagle3", "Eagle3LlamaForCausalLM")`) and
  `llama_eagle3.py`: `load_weights` maps `midlayer.` to `layers.0.`, prefixes `model.` to every
  name without `lm_head`, renames `d2t` to `draft_id_to_target_id`, skips `t2d` and a missing
  `embed_tokens`, fuses q/k/v and gate/up itself; the first layer's q/k/v take 2 x hidden
  inputs, `fc` takes 3 x (`target_hidden_size` or hidden); `lm_head` has `draft_vocab_size`
  rows; `norm_before_residual` (default False there) picks where `hidden_norm` sits. Taps are
  read from `eagle_aux_hidden_state_layer_ids` (boundary indices: draftflow id + 1).
* **speculators** (vllm-project/speculators `models/eagle3/config.py`,
  `Eagle3SpeculatorConfig`): `speculators_model_type: "eagle3"`, `transformer_layer_config`
  (a Llama config), `draft_vocab_size`, `norm_before_residual`, `target_hidden_size`,
  `eagle_aux_hidden_state_layer_ids`; weights named `layers.0.*` (its converter
  `convert/eagle/eagle3_converter.py` remaps `midlayer.*` to `layers.0.*`). vLLM's
  `update_eagle3` (`transformers_utils/configs/speculators/algos.py`) defaults
  `norm_before_residual` to True when absent, so it is always written (False).

Every export folder also holds a `README.md` with the exact `vllm serve` line
(`draftflow.export_readme`), and names its target portably (a hub id or a folder's name, never an
absolute path). The vLLM DFlash folder also carries `modeling_dflash.py`
(`draftflow/models/modeling_dflash.py`, copied) and an `auto_map` naming it, so
`AutoModel.from_pretrained(DIR, trust_remote_code=True)` builds the drafter; `model_type`
stays "qwen3" and `auto_map` names no `AutoConfig`, so vLLM (which picks its DFlash model by
`architectures` and loads the config with Qwen3Config) reads the folder as before.

What it does not know: training, stores (it writes a local folder; the train stage copies
it into the artifact store). Trade-off: one rename table shared by both formats and
by `load_exported`, so a name vLLM would not recognise fails the export, not the server.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from draftflow.compat import config_dtype
from draftflow.errors import StoreError
from draftflow.export_readme import README_NAME, portable_target_name, write_readme
from draftflow.layers import engine_layer_id, engine_layer_index
from draftflow.models.dflash import SHARED_PREFIXES, DFlashDrafter
from draftflow.models.dflash_config import DFlashConfig
from draftflow.models.weights import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    load_exact,
    read_weights_and_config,
    write_weights_and_config,
)
from draftflow.store import write_local_atomic

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
EXPORT_FILES = (CONFIG_NAME, WEIGHTS_NAME, README_NAME)  # in every export folder
MODELING_NAME = "modeling_dflash.py"
# What the drafter was trained on that serving does not need but a later evaluation does (the feature
# rounding: `evaluate.compare_with` of an export). Written by the train stage beside its exports only.
TRAINED_ON_NAME = "draftflow.json"
# Only AutoModel: an AutoConfig entry would make vLLM and AutoConfig need trust_remote_code.
AUTO_MAP = {"AutoModel": "modeling_dflash.DFlashDraftModel"}


def modeling_file() -> Path:
    """draftflow's transformers modeling file for DFlash exports (imports only torch and transformers)."""
    from draftflow.models import modeling_dflash  # imported, not only located: the train stage's code hash sees it

    return Path(modeling_dflash.__file__)


def default_target_name(target_config: Any) -> str:
    """The portable name of the target a config was loaded from (`_name_or_path`; "target" when unset)."""
    return portable_target_name(getattr(target_config, "_name_or_path", None) or None, "target")


# ----------------------------------------------------------------------------- names


def rename_tensor(name: str, table: dict[str, str]) -> str:
    for src, dst in table.items():
        if name.startswith(src):
            return dst + name[len(src):]
    raise StoreError(f"parameter {name!r} has no entry in draftflow.export.VLLM_NAMES; add one")


def export_state_dict(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """draftflow names -> exported names, dropping the shared embedding and LM head."""
    own = {k: v for k, v in weights.items() if not k.startswith(SHARED_PREFIXES)}
    return {rename_tensor(k, VLLM_NAMES): v.detach().cpu().contiguous() for k, v in own.items()}


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


def dtype_name(target_config: Any) -> str:
    dtype = config_dtype(target_config) or "bfloat16"
    return str(dtype).removeprefix("torch.")


def vllm_config(cfg: DFlashConfig, target_config: Any) -> dict[str, Any]:
    """config.json for vLLM's DFlashDraftModel."""
    return qwen3_dims(cfg, target_config) | {
        "architectures": ["DFlashDraftModel"],
        "auto_map": AUTO_MAP,  # transformers: modeling_dflash.py in the folder; vLLM ignores it
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "target_hidden_size": cfg.hidden_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
    }


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


def write_export(out_dir: str | Path, config: dict, weights: dict[str, torch.Tensor], target_name: str,
                 served_from: str | None = None, target_config: Any = None) -> Path:
    """An export folder: `config.json`, `model.safetensors` (already renamed), `README.md`, and the
    modeling file when `config` has an `auto_map`; each file written atomically.

    Args:
        target_name: the portable target name the README's serve line uses.
        served_from: the folder's path in the serve line; default: `out_dir`, absolute.
        target_config: the target's HF config; the README reads its folder (`_name_or_path`) for a GGUF
            target's conversion record.
    """
    out = write_weights_and_config(out_dir, weights, config)
    if config.get("auto_map"):
        source = modeling_file().read_bytes()
        write_local_atomic(out / MODELING_NAME, lambda tmp: Path(tmp).write_bytes(source))
    write_readme(out, config, target_name, served_from or str(out.resolve()),
                 getattr(target_config, "_name_or_path", None) or None)
    return out


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
        `out_dir` as a Path, holding `EXPORT_FILES` and `MODELING_NAME`.
    """
    cfg, weights = _read_checkpoint(checkpoint_dir)
    target_name = target_name or default_target_name(target_config)
    return write_export(out_dir, vllm_config(cfg, target_config), export_state_dict(weights), target_name,
                        served_from, target_config)


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
    return write_export(out_dir, config, export_state_dict(weights), target_name, served_from, target_config)


def write_trained_on(out_dir: str | Path, trained_on: dict[str, Any]) -> None:
    """`TRAINED_ON_NAME` in an export folder, atomically (keys sorted: the same training, the same bytes)."""
    text = json.dumps(trained_on, indent=2, sort_keys=True) + "\n"
    write_local_atomic(Path(out_dir) / TRAINED_ON_NAME, lambda tmp: Path(tmp).write_text(text))


def read_trained_on(folder: str | Path) -> dict[str, Any]:
    """An export folder's `TRAINED_ON_NAME` ({} when it has none: exported outside a train stage, or before it
    was written)."""
    path = Path(folder) / TRAINED_ON_NAME
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise StoreError(f"{path}: not JSON ({exc}); delete it or re-export the drafter") from None
    return data if isinstance(data, dict) else {}


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
