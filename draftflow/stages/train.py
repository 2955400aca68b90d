"""Train stage: feature shards -> a DFlash drafter checkpoint.

Training runs in a local work folder (`<root>/train/<fp>/work` for a local
root) that keeps periodic checkpoints, so a crashed run resumes from its last
checkpoint with the same result as an uninterrupted one. The final weights,
config and metrics are then committed atomically under `checkpoint/`, and the
manifest is written last.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from draftflow.config import RunConfig
from draftflow.errors import ConfigError
from draftflow.features import load_samples
from draftflow.models.dflash import DFlashConfig
from draftflow.stages.common import data_shards, finalize
from draftflow.store import Store, shard_entry
from draftflow.target import TargetRef, default_cache_dir, load_target

log = logging.getLogger(__name__)
STAGE = "train"
CHECKPOINT_FILES = ("model.safetensors", "config.json", "metrics.json")


def mask_token_id(tokenizer) -> int:
    """The tokenizer's mask token, else `len(tokenizer)` (DFlash; Qwen3 gives 151669)."""
    return tokenizer.mask_token_id if tokenizer.mask_token_id is not None else len(tokenizer)


def check_taps(dcfg: DFlashConfig, shards: list[dict[str, Any]]) -> None:
    """The drafter's taps must be the ones the features were extracted at."""
    for s in shards:
        if list(s["layer_ids"]) != list(dcfg.target_layer_ids):
            raise ConfigError(
                f"feature shard {s['name']} holds taps {s['layer_ids']} but the drafter wants "
                f"{dcfg.target_layer_ids}; re-run extract with the same drafter.target_layer_ids"
            )


def work_dir(store: Store, fp: str) -> str:
    if store.is_local:
        return store.stage_path(STAGE, fp, "work")
    key = hashlib.sha256(store.stage_path(STAGE, fp).encode()).hexdigest()[:16]
    return str(default_cache_dir() / "train-work" / key)


def run(store: Store, fp: str, cfg: RunConfig, target: TargetRef, inputs: dict[str, str],
        features: dict[str, Any]) -> dict[str, Any]:
    """Train the drafter on every train feature shard; return the stage manifest."""
    from draftflow.train import train_drafter

    shards = data_shards(features["manifest"], "train")
    model, tokenizer = load_target(target.path, cfg.target.dtype, cfg.target.device)
    dcfg = DFlashConfig.from_target(model.config, cfg.drafter, mask_token_id(tokenizer))
    check_taps(dcfg, shards)
    samples = load_samples([store.verify_sha("extract", features["fingerprint"], s) for s in shards])
    out = work_dir(store, fp)
    metrics = train_drafter(samples, model, dcfg, cfg.train, out)
    entries = []
    for name in CHECKPOINT_FILES:
        with store.writing(store.stage_path(STAGE, fp, "checkpoint", name)) as tmp:
            Path(tmp).write_bytes((Path(out) / name).read_bytes())
            entries.append(shard_entry(f"checkpoint/{name}", tmp, rows=0))
    tokens = sum(int(s.input_ids.numel()) for s in samples)
    result = {"shard": None, "rejected": None, "rows_in": len(samples), "rows_out": len(samples), "dropped": {}}
    manifest_results = [result] + [{"shard": e | {"tokens": 0}, "rejected": None, "rows_in": 0, "rows_out": 0,
                                    "dropped": {}} for e in entries]
    extra = {"checkpoint": store.url(store.stage_path(STAGE, fp, "checkpoint")), "metrics": metrics,
             "trained_tokens": tokens}
    return finalize(store, STAGE, fp, cfg, inputs, manifest_results, extra=extra)
