"""Weight I/O every drafter shares: frozen target modules borrowed and never saved, one
`model.safetensors` + `config.json` per folder written atomically, and an exact-key load.

What it does not know: any drafter's architecture (a drafter subclasses `SharedTargetDrafter` and
names its shared modules in `shared_prefixes`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from draftflow.errors import ConfigError, StoreError
from draftflow.store import write_local_atomic

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


class SharedTargetDrafter(nn.Module):
    """What every drafter borrowing frozen target modules shares: those modules (`shared_prefixes`)
    are never saved nor counted as trainable; the rest is written by `write_weights_and_config`."""

    shared_prefixes: tuple[str, ...] = ()
    decoder_prefix: str = "layers"  # the drafter's decoder layers: a ModuleList, or one layer

    def decoder_layers(self) -> list[nn.Module]:
        """The drafter's own decoder layers, first to last (`decoder_prefix`)."""
        found = getattr(self, self.decoder_prefix)
        return list(found) if isinstance(found, nn.ModuleList) else [found]

    def init_beyond_names(self, sources: list[nn.Module]) -> list[str]:
        """What a kind starts from its target beyond the tensors of matching name and shape (`init_from_target_layers`
        copies those first; `sources` are the target layers its own layers start as). Returns what it set."""
        return []

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Every drafter weight and buffer except the shared target modules."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(self.shared_prefixes)}

    def param_counts(self) -> tuple[int, int]:
        """(trainable, frozen) parameter counts; frozen = the shared target modules."""
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in self.parameters() if not p.requires_grad)
        return trainable, frozen

    def save(self, out_dir: str | Path) -> None:
        """Write `model.safetensors` (`trainable_state_dict`) and `config.json` to a local dir."""
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.trainable_state_dict().items()}
        write_weights_and_config(out_dir, tensors, self.config.to_dict())


def init_from_target_layers(drafter: SharedTargetDrafter, target_model: nn.Module) -> list[str]:
    """Copy the target's last decoder layers into the drafter's (`train.init_from_target`).

    Drafter layer i of n takes target layer N-n+i; within a layer every tensor whose name and shape
    match is copied (DFlash: all but the q/k norms a Llama target lacks; EAGLE-3: o_proj, the MLP
    and the norms, its q/k/v read 2 x hidden), then what the kind maps itself (`init_beyond_names`). On
    SmolLM2-135M this took a 2-layer DFlash drafter from 21% to 41% slot-1 accuracy at 600 steps on the same data
    (README, 2026-12-02).

    Returns:
        The copied tensor names, prefixed by the drafter's layer index ("0.mlp.up_proj.weight"), then the kind's.
    """
    target_layers = list(_target_decoder(target_model).layers)
    mine = drafter.decoder_layers()
    copied: list[str] = []
    with torch.no_grad():
        for i, (layer, source) in enumerate(zip(mine, target_layers[-len(mine):], strict=True)):
            theirs = source.state_dict()
            for name, tensor in layer.state_dict().items():
                if name in theirs and theirs[name].shape == tensor.shape:
                    tensor.copy_(theirs[name].to(tensor.dtype))
                    copied.append(f"{i}.{name}")
        copied += drafter.init_beyond_names(target_layers[-len(mine):])
    return copied


def _target_decoder(target_model: nn.Module) -> nn.Module:
    decoder = target_model.get_decoder() if hasattr(target_model, "get_decoder") else target_model.model
    if not hasattr(decoder, "layers"):
        raise ConfigError(f"train.init_from_target: {type(target_model).__name__} has no decoder layers to copy; "
                          "set train.init_from_target=false")
    return decoder


def write_weights_and_config(out_dir: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """`model.safetensors` + `config.json` in a local folder, each written atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_local_atomic(out / WEIGHTS_NAME, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    text = json.dumps(config, indent=2, sort_keys=True)
    write_local_atomic(out / CONFIG_NAME, lambda p: Path(p).write_text(text))
    return out


def read_weights_and_config(in_dir: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json as data, the weights) of a folder `write_weights_and_config` wrote.

    Raises:
        StoreError: either file is missing.
    """
    folder = Path(in_dir)
    if not (folder / CONFIG_NAME).is_file() or not (folder / WEIGHTS_NAME).is_file():
        raise StoreError(f"{folder} has no {CONFIG_NAME} + {WEIGHTS_NAME}; train a drafter first")
    return json.loads((folder / CONFIG_NAME).read_text()), load_file(str(folder / WEIGHTS_NAME))


def load_exact(model: SharedTargetDrafter, weights: dict[str, torch.Tensor], where: str | Path):
    """`model` holding exactly `weights` (its `trainable_state_dict` names), moved to the device of
    the target modules it shares.

    Raises:
        StoreError: a name missing or unexpected.
    """
    expected = set(model.trainable_state_dict())
    if set(weights) != expected:
        raise StoreError(f"the weights in {where} do not match their config: missing "
                         f"{sorted(expected - set(weights))[:5]}, unexpected {sorted(set(weights) - expected)[:5]}")
    model.load_state_dict(weights, strict=False)
    return model.to(model.embed_tokens.weight.device)
