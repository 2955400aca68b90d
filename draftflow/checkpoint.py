"""Training checkpoints: weights, optimizer, scheduler, RNG and loop state in one folder.

A checkpoint is written to a temporary folder and renamed into place, so a
folder named `step_*` is always complete; the newest `KEEP_CHECKPOINTS` are kept.
A checkpoint remembers the settings it was written with (`meta`) and refuses to
resume a run with different ones. Knows nothing of the loss or the data.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftflow.errors import ConfigError
from draftflow.models.dflash import DFlashDrafter

CKPT_DIR = "checkpoints"
KEEP_CHECKPOINTS = 2


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder under `out_dir/checkpoints`, if any."""
    root = Path(out_dir) / CKPT_DIR
    done = sorted(p for p in root.glob("step_*") if p.is_dir()) if root.is_dir() else []
    return done[-1] if done else None


def save_checkpoint(out_dir: str | Path, drafter: DFlashDrafter, opt, sched, state: dict, meta: dict) -> Path:
    """Write weights + optimizer + scheduler + loop state to a temp folder, then rename."""
    root = Path(out_dir) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{state['step']:08d}"
    tmp = root / f".tmp_{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    weights = {k: v.detach().cpu().contiguous() for k, v in drafter.trainable_state_dict().items()}
    save_file(weights, str(tmp / "model.safetensors"))
    torch.save(
        {
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "loop": state,
        },
        tmp / "state.pt",
    )
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)  # the folder appears complete or not at all
    for old in sorted(root.glob("step_*"))[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, drafter: DFlashDrafter, opt, sched, meta: dict, device: torch.device) -> dict:
    """Restore a checkpoint into live objects; return the loop state.

    Raises:
        ConfigError: the checkpoint was written by a run with different settings.
    """
    saved = json.loads((path / "meta.json").read_text())
    if saved != meta:
        diff = sorted(k for k in set(saved) | set(meta) if saved.get(k) != meta.get(k))
        raise ConfigError(
            f"checkpoint {path} was written with different settings ({diff}); "
            "delete that checkpoints folder or train into a new output folder"
        )
    drafter.load_state_dict(load_file(str(path / "model.safetensors"), device=str(device)), strict=False)
    blob = torch.load(path / "state.pt", map_location=device, weights_only=True)
    opt.load_state_dict(blob["optimizer"])
    sched.load_state_dict(blob["scheduler"])
    torch.set_rng_state(blob["torch_rng"].cpu())
    return blob["loop"]
