"""Training checkpoints: weights, optimizer, scheduler, RNG and loop state in one folder.

A checkpoint is written to a temporary folder and renamed into place, so a
folder named `step_*` is always complete; the newest `KEEP_CHECKPOINTS` are kept.
Its last file, `checksums.json`, holds every other file's size and sha256: resume
(`resumable_checkpoint`) verifies them, so a checkpoint torn by a crash or a copy, or
changed by one flipped bit, is never trained on. A bad one is renamed `corrupt_step_*`
(kept for inspection, never read again) with one warning line, and the previous good one
is used; when none is good the run stops in one line and the re-run trains from step 0.
A checkpoint remembers the settings it was written with (`meta`) and refuses to
resume a run with different ones. Knows nothing of the loss or the data.

One format for every way of training: the *full* (unsharded) trainable weights in
`model.safetensors` (the same file as the final drafter) and the optimizer state keyed by
parameter name (`torch.distributed.checkpoint.state_dict`'s full state dict). Under FSDP2
gathering it is a collective, so every rank calls `save_checkpoint` and rank 0 writes;
loading scatters it back into shards. A checkpoint written by 2 FSDP ranks therefore
resumes on 1 process, under DDP or on another number of ranks, and vice versa.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftflow.errors import ConfigError, DraftflowError
from draftflow.models.weights import write_weights_and_config
from draftflow.store import writer_errors
from draftflow.training.distributed import DistEnv, is_fsdp

log = logging.getLogger(__name__)

CKPT_DIR = "checkpoints"
KEEP_CHECKPOINTS = 2
CHECKSUMS = "checksums.json"  # written last: a folder without it never finished
CORRUPT_PREFIX = "corrupt_"


class CheckpointError(DraftflowError):
    """No checkpoint in the work folder passed its checksums (they were moved aside)."""


def _state_dict():
    """torch.distributed.checkpoint.state_dict, imported when first used: importing it takes ~1.7 s of every CLI
    start's ~9 s on 2 cores, and most runs (plan, status, the stages before train) never save a checkpoint."""
    from torch.distributed.checkpoint import state_dict

    return state_dict


def _gather():
    """Full tensors, gathered to CPU on rank 0 only; the frozen target modules are never saved."""
    return _state_dict().StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)


def _scatter(**more):
    return _state_dict().StateDictOptions(full_state_dict=True, strict=False, **more)


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder under `out_dir/checkpoints`, if any."""
    root = Path(out_dir) / CKPT_DIR
    done = sorted(p for p in root.glob("step_*") if p.is_dir()) if root.is_dir() else []
    return done[-1] if done else None


def full_weights(drafter: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The drafter's saved tensors (`trainable_state_dict` names), whole and on CPU.

    Under FSDP a collective: every rank must call it; ranks other than 0 get `{}`.
    """
    keys = list(drafter.trainable_state_dict())
    if not is_fsdp(drafter):
        local = drafter.trainable_state_dict()
        return {k: local[k].detach().cpu().contiguous() for k in keys}
    full = _state_dict().get_model_state_dict(drafter, options=_gather())
    return {k: full[k].contiguous() for k in keys} if full else {}


def load_weights(drafter: torch.nn.Module, weights: dict[str, torch.Tensor] | None) -> None:
    """Put whole trainable tensors (`full_weights`' output) back into the live drafter. Under FSDP every rank
    calls it and rank 0's copy is broadcast (the others may hold none)."""
    if not is_fsdp(drafter):
        _state_dict().set_model_state_dict(drafter, weights or {}, options=_scatter())
        return
    _state_dict().set_model_state_dict(drafter, weights or {}, options=_scatter(broadcast_from_rank0=True))


def save_drafter(drafter: torch.nn.Module, out_dir: str | Path, env: DistEnv) -> None:
    """The final `model.safetensors` + `config.json` (rank 0), the same files with or without FSDP."""
    if not is_fsdp(drafter):
        if env.is_main:
            drafter.save(out_dir)
        return
    tensors = full_weights(drafter)
    if env.is_main:
        write_weights_and_config(out_dir, tensors, drafter.config.to_dict())


def save_checkpoint(out_dir: str | Path, drafter, opt, sched, state: dict, meta: dict,
                    env: DistEnv | None = None) -> Path | None:
    """Write weights + optimizer + scheduler + loop state to a temp folder, then rename (rank 0).

    Every rank calls it (FSDP gathers shards); returns the folder on rank 0, None elsewhere.
    """
    env = env or DistEnv()
    if not env.is_main and not is_fsdp(drafter):
        return None  # replicated: rank 0 has it all
    weights = full_weights(drafter)
    optim = _state_dict().get_optimizer_state_dict(drafter, opt, options=_gather())
    if not env.is_main:
        return None
    root = Path(out_dir) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{state['step']:08d}"
    tmp = root / f".tmp_{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        with writer_errors(tmp):  # a full device is an OSError naming the folder, whichever library wrote
            save_file(weights, str(tmp / "model.safetensors"))
            blob = {"optimizer": optim, "scheduler": sched.state_dict(), "torch_rng": torch.get_rng_state(),
                    "loop": state}
            torch.save(blob, tmp / "state.pt")
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
            _write_checksums(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # never a checkpoint; its space is freed
        raise
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)  # the folder appears complete or not at all
    for old in sorted(root.glob("step_*"))[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_checksums(folder: Path) -> None:
    """Flush every file to disk, then record its size and sha256 in `CHECKSUMS` (last, flushed too)."""
    files = {}
    for f in sorted(p for p in folder.iterdir() if p.is_file()):
        with open(f, "rb+") as fh:
            os.fsync(fh.fileno())
        files[f.name] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
    out = folder / CHECKSUMS
    with open(out, "w") as fh:
        fh.write(json.dumps(files, indent=2, sort_keys=True))
        fh.flush()
        os.fsync(fh.fileno())


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint folder `path` must not be resumed from (sizes first, then sha256), or None."""
    try:
        listed = json.loads((path / CHECKSUMS).read_text())
    except FileNotFoundError:
        return f"no {CHECKSUMS}: its writing never finished"
    except (OSError, ValueError) as exc:
        return f"{CHECKSUMS} unreadable ({exc.__class__.__name__})"
    if not isinstance(listed, dict) or not {"model.safetensors", "state.pt", "meta.json"} <= set(listed):
        return f"{CHECKSUMS} does not list model.safetensors, state.pt and meta.json"
    for name, want in sorted(listed.items()):
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != want.get("bytes"):
            return f"{name} has {f.stat().st_size} bytes, {want.get('bytes')} were written"
    for name, want in sorted(listed.items()):
        if _sha256(path / name) != want.get("sha256"):
            return f"{name} differs from its checksum"
    return None


def resumable_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest checkpoint that passes its checksums; bad newer ones are moved aside with a warning.

    Raises:
        CheckpointError: checkpoints exist but none is good (all moved aside: the re-run starts at step 0).
    """
    bad: list[str] = []
    while (ckpt := latest_checkpoint(out_dir)) is not None:
        problem = checkpoint_problem(ckpt)
        if problem is None:
            return ckpt
        aside = ckpt.with_name(CORRUPT_PREFIX + ckpt.name)
        shutil.rmtree(aside, ignore_errors=True)
        try:
            ckpt.rename(aside)
        except FileNotFoundError:  # another rank of this node moved it first
            pass
        log.warning("checkpoint %s is unusable (%s): moved to %s, trying the one before", ckpt, problem, aside.name)
        bad.append(f"{ckpt.name} ({problem})")
    if bad:
        raise CheckpointError(f"no usable checkpoint in {Path(out_dir) / CKPT_DIR}: {'; '.join(bad)}; moved aside "
                              f"as {CORRUPT_PREFIX}step_*; re-run to train from step 0")
    return None


def load_checkpoint(path: Path, drafter, opt, sched, meta: dict, device: torch.device) -> dict:
    """Restore a checkpoint into live (possibly sharded) objects; return the loop state.

    Every rank reads the folder (a shared filesystem when nodes differ).

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
    try:  # checksums passed, so this fails only on a file written wrong in the first place
        weights = load_file(str(path / "model.safetensors"), device=str(device))
        blob = torch.load(path / "state.pt", map_location=device, weights_only=True)
    except (OSError, RuntimeError, ValueError, pickle.UnpicklingError) as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read ({exc.__class__.__name__}: {str(exc)[:120]}); "
                              "delete it and re-run to resume from the one before") from None
    _state_dict().set_model_state_dict(drafter, weights, options=_scatter())
    _state_dict().set_optimizer_state_dict(drafter, opt, blob["optimizer"], options=_scatter())
    sched.load_state_dict(blob["scheduler"])
    torch.set_rng_state(blob["torch_rng"].cpu())
    return blob["loop"]
