"""EAGLE-3 exports: vLLM's native layout and the speculators format, and loading either back.

Facts relied on:

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

Both hold the drafter's own weights plus the `d2t` (int64, draft id -> target id offset) and `t2d`
(bool over the target vocabulary) tensors, no embedding, no target LM head. The folder writer,
README and names are every kind's (`draftflow.drafters.export`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from draftflow.drafters.eagle3.config import Eagle3Config
from draftflow.drafters.eagle3.model import SHARED_PREFIXES as EAGLE3_SHARED
from draftflow.drafters.eagle3.model import Eagle3Drafter
from draftflow.drafters.export import KindFiles, default_target_name, dtype_name, rename_tensor, renamed, write_export
from draftflow.export_readme import serve_entry
from draftflow.layers import engine_layer_id, engine_layer_index
from draftflow.models.weights import WEIGHTS_NAME, read_weights_and_config

# draftflow name prefix -> speculators name prefix (vLLM native keeps draftflow's names).
EAGLE3_SPECULATORS_NAMES: dict[str, str] = {
    "midlayer.": "layers.0.",  # the first decoder layer (the paper's only one)
    "fc.": "fc.",  # (D, 3D), no bias
    "norm.": "norm.",
    "lm_head.": "lm_head.",  # (draft_vocab_size, D)
    "d2t": "d2t",
    "t2d": "t2d",
}
EAGLE3_VLLM_NAMES = {k: k for k in EAGLE3_SPECULATORS_NAMES}
TITLE = KindFiles("EAGLE-3")


def with_later_layers(table: dict[str, str], num_layers: int) -> dict[str, str]:
    """`table` for a drafter of `num_layers` decoder layers: each layer after `midlayer` (`later.i.`) is
    `layers.<i+1>.` in both formats (vLLM's `LlamaModel` builds `num_hidden_layers` layers, the first reading
    [embedding, hidden])."""
    return {**{f"later.{i}.": f"layers.{i + 1}." for i in range(num_layers - 1)}, **table}


def llama_dims(cfg: Eagle3Config, target_config: Any) -> dict[str, Any]:
    """The EAGLE-3 layer as the Llama config vLLM's Eagle3LlamaForCausalLM reads."""
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,  # the drafter uses plain RoPE
        "vocab_size": cfg.vocab_size,  # the target's; the head has draft_vocab_size rows
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "max_position_embeddings": int(getattr(target_config, "max_position_embeddings", 32768)),
        "torch_dtype": dtype_name(target_config),
    }


def eagle3_vllm_config(cfg: Eagle3Config, target_config: Any) -> dict[str, Any]:
    """config.json of vLLM's native EAGLE-3 layout (see the module docstring)."""
    aux = [engine_layer_index("vllm", i) for i in cfg.target_layer_ids]  # boundary indices
    return llama_dims(cfg, target_config) | {
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": aux,
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": aux},
        "num_target_layers": cfg.num_target_layers,
        "ttt_steps": cfg.ttt_steps,
    } | serve_entry("eagle3", cfg.ttt_steps)


def eagle3_speculators_config(cfg: Eagle3Config, target_config: Any, verifier: str | None = None) -> dict[str, Any]:
    """config.json in the speculators EAGLE-3 format (see the module docstring)."""
    verifier = verifier or default_target_name(target_config)
    return {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": llama_dims(cfg, target_config),
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": False,
        "target_hidden_size": cfg.hidden_size,
        "eagle_aux_hidden_state_layer_ids": [engine_layer_index("vllm", i) for i in cfg.target_layer_ids],
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.ttt_steps}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier,
                         "architectures": list(getattr(target_config, "architectures", None) or [])},
        },
    }


def _eagle3_checkpoint(checkpoint_dir: str | Path) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    config, weights = read_weights_and_config(checkpoint_dir)
    return Eagle3Config.from_dict(config), {k: v for k, v in weights.items() if not k.startswith(EAGLE3_SHARED)}


def export_eagle3_vllm(checkpoint_dir: str | Path, out_dir: str | Path, target_config: Any,
                       target_name: str | None = None, served_from: str | None = None) -> Path:
    """Write a folder vLLM serves as an EAGLE-3 speculative model (native layout); arguments as
    for `export_vllm_dflash`."""
    cfg, weights = _eagle3_checkpoint(checkpoint_dir)
    config = eagle3_vllm_config(cfg, target_config)
    return write_export(out_dir, config, renamed(weights, with_later_layers(EAGLE3_VLLM_NAMES, cfg.num_layers)),
                        target_name or default_target_name(target_config), served_from, target_config, TITLE)


def export_eagle3_speculators(checkpoint_dir: str | Path, out_dir: str | Path, target_config: Any,
                              target_name: str | None = None, served_from: str | None = None) -> Path:
    """Write an EAGLE-3 drafter in the speculators format; arguments as for `export_speculators`."""
    cfg, weights = _eagle3_checkpoint(checkpoint_dir)
    target_name = target_name or default_target_name(target_config)
    config = eagle3_speculators_config(cfg, target_config, target_name)
    table = with_later_layers(EAGLE3_SPECULATORS_NAMES, cfg.num_layers)
    return write_export(out_dir, config, renamed(weights, table), target_name, served_from, target_config, TITLE)


def eagle3_config_from_export(data: dict[str, Any]) -> Eagle3Config:
    """Rebuild an Eagle3Config from either exported config.json."""
    dims = data["transformer_layer_config"] if "transformer_layer_config" in data else data
    ids = [engine_layer_id("vllm", i) for i in data["eagle_aux_hidden_state_layer_ids"]]
    steps = data.get("ttt_steps") or data.get("speculators_config", {}).get("proposal_methods", [{}])[0].get(
        "speculative_tokens", 7)
    return Eagle3Config.from_dict({
        "hidden_size": dims["hidden_size"], "num_heads": dims["num_attention_heads"],
        "num_kv_heads": dims["num_key_value_heads"], "head_dim": dims["head_dim"],
        "intermediate_size": dims["intermediate_size"], "rms_norm_eps": dims["rms_norm_eps"],
        "rope_theta": dims["rope_theta"], "vocab_size": dims["vocab_size"],
        "draft_vocab_size": data["draft_vocab_size"], "target_layer_ids": ids,
        # speculators does not record the target's depth; any valid bound will do
        "num_target_layers": data.get("num_target_layers") or max(ids) + 2, "ttt_steps": steps,
        "num_layers": dims.get("num_hidden_layers", 1),
    })


def load_exported_eagle3(folder: Path, data: dict[str, Any], target_model: torch.nn.Module) -> Eagle3Drafter:
    """An exported EAGLE-3 folder back as an `Eagle3Drafter` (either format)."""
    cfg = eagle3_config_from_export(data)
    table = EAGLE3_SPECULATORS_NAMES if data.get("speculators_model_type") == "eagle3" else EAGLE3_VLLM_NAMES
    back = {dst: src for src, dst in with_later_layers(table, cfg.num_layers).items()}
    weights = {rename_tensor(k, back): v for k, v in load_file(str(folder / WEIGHTS_NAME)).items()}
    return Eagle3Drafter.from_weights(cfg, weights, target_model, str(folder))
