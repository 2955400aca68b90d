"""Extract: the target's hidden states at the drafter's taps, packed in feature shards.

Tap ids follow DFlash semantics (`draftflow.layers`): id L is the output of
decoder layer L, `hidden_states[L + 1]`; the ids stored are the drafter kind's
(`draftflow.drafters.taps.feature_ids`; EAGLE-3 adds `layers.FINAL`, the target's final normed state).
A capture engine (`draftflow.engines.capture`:
transformers hooks on the tap layers only, or vLLM) runs length-sorted batches,
halved on CUDA out-of-memory; features are stored bf16, fp32 or fp8 with
per-token scales (`draftflow.features`), many samples per shard.

Resume: at shard granularity through the task cache; inside a shard, every
`checkpoint_every` sequences are committed as a part file under
`partial/<shard>/`, and a restarted shard skips the sample ids already in its
parts. The final shard is the parts merged by byte copy, in input order; the
parts are then removed.

Corruption: `bad_shards` checks a stage's feature shards against the manifest: by
size before a complete stage is reused (cheap), by sha256 for shards taken from the
task cache after a crash; the train stage hashes what it reads. The shards that fail
are re-run (a truncated file also fails `FeatureShard`'s size check on read).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterable
from typing import Any

import torch

from draftflow import progress
from draftflow.compat import importing_transformers
from draftflow.config import RunConfig
from draftflow.contracts import Manifest, ShardEntry, ShardResult, StageResult, Stamp, carry
from draftflow.data.schema import read_rows
from draftflow.drafters.taps import feature_ids
from draftflow.engines.capture import capture_in_batches, make_capture_engine
from draftflow.errors import ConfigError
from draftflow.features import FeatureSample, FeatureShard, merge_feature_shards, sha256_of, write_feature_shard
from draftflow.stages.common import Source, finalize, shard_result
from draftflow.store import MANIFEST, Store, shard_entry
from draftflow.target import TargetRef, resolve_device

log = logging.getLogger(__name__)
STAGE = "extract"


def target_depth(target_path: str) -> int:
    """Decoder layers of the target, from its config (no weights loaded)."""
    with importing_transformers():
        from transformers import AutoConfig

    return AutoConfig.from_pretrained(target_path).num_hidden_layers


def sample_key(row: dict[str, Any]) -> str:
    """A tokenize row's id in feature shards: conversation id and row number."""
    return f"{row['sample_id']}:{row['row']}"


def capture(model, batch_ids: list[list[int]], layer_ids: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """Tap features per sequence, (T_i, n_taps, D) in `dtype`, for callers holding a loaded HF model."""
    from draftflow.engines.capture import HFCapture

    return [f.to(dtype) for f in HFCapture(model, layer_ids).capture(batch_ids)]


# -- in-shard checkpoints ------------------------------------------------------------------------
def _partial_dir(store: Store, fp: str, name: str) -> str:
    return store.stage_path(STAGE, fp, "partial", name.rsplit(".", 1)[0])


def _part_paths(store: Store, fp: str, name: str) -> list[str]:
    folder = _partial_dir(store, fp, name)
    if not store.exists(folder):
        return []
    return sorted(p for p in store.fs.ls(folder, detail=False) if p.endswith(".safetensors"))


def _open_parts(store: Store, paths: list[str], tmp: str) -> list[FeatureShard]:
    """Parts as readable shards; on S3 each is downloaded afresh into `tmp` (parts are re-created
    under the same names after a shard is recomputed, so no cached copy may be trusted)."""
    if store.is_local:
        return [FeatureShard(p) for p in paths]
    out = []
    for i, p in enumerate(paths):
        local = os.path.join(tmp, f"part-{i:05d}.safetensors")
        store.fs.get_file(p, local)
        out.append(FeatureShard(local))
    return out


def _save_part(store: Store, fp: str, name: str, k: int, samples: list[FeatureSample], layer_ids: list[int],
               dtype: str) -> None:
    with store.writing(f"{_partial_dir(store, fp, name)}/part-{k:05d}.safetensors") as tmp:
        write_feature_shard(tmp, samples, layer_ids, dtype)


def _clear_parts(store: Store, fp: str, name: str) -> None:
    folder = _partial_dir(store, fp, name)
    if store.exists(folder):
        store.fs.rm(folder, recursive=True)


# -- the shard -----------------------------------------------------------------------------------
def extract_rows(store: Store, fp: str, cfg: RunConfig, target: TargetRef, name: str, rows: list[dict],
                 done: set[str], layer_ids: list[int], first_part: int) -> None:
    """Capture the rows not in `done`, committing a part every `extract.checkpoint_every` sequences."""
    xcfg = cfg.extract
    todo = [r for r in rows if sample_key(r) not in done]
    if not todo:
        return
    engine = make_capture_engine(xcfg.engine, target.path, layer_ids, cfg.target.dtype, cfg.target.device,
                                 cfg.regenerate.vllm)
    batch = xcfg.batch_size
    for k, lo in enumerate(range(0, len(todo), xcfg.checkpoint_every)):
        chunk = todo[lo:lo + xcfg.checkpoint_every]
        feats, batch = capture_in_batches(engine, [r["input_ids"] for r in chunk], batch)
        samples = [FeatureSample(sample_key(r), torch.tensor(r["input_ids"]),
                                 torch.tensor(r["loss_mask"], dtype=torch.bool), f) for r, f in zip(chunk, feats)]
        _save_part(store, fp, name, first_part + k, samples, layer_ids, xcfg.dtype)
        progress.report(STAGE, len(rows) - len(todo) + lo + len(chunk), len(rows), part=name)


def run_shard(store: Store, fp: str, cfg: RunConfig, target: TargetRef, source: Source,
              shard: ShardEntry) -> ShardResult:
    """Extract features for one tokenize shard into one feature shard (resumable inside the shard)."""
    layer_ids = feature_ids(cfg.drafter, target_depth(target.path))
    rows = read_rows(store.verify_sha(*source, shard))
    if not rows:  # empty is a value: nothing to capture, no feature shard (a shard needs one sample)
        return shard_result(None, None, 0, 0, {})
    name = shard.name.replace(".parquet", ".safetensors")
    with tempfile.TemporaryDirectory(prefix="draftflow-extract-") as tmp:
        parts = _open_parts(store, _part_paths(store, fp, name), tmp)
        done = {sid for p in parts for sid in p.sample_ids}
        if done:
            log.info("%s: resuming, %d of %d sequences already extracted", name, len(done), len(rows))
        extract_rows(store, fp, cfg, target, name, rows, done, layer_ids, len(parts))
        parts = _open_parts(store, _part_paths(store, fp, name), tmp)
        with store.writing(store.stage_path(STAGE, fp, name)) as out:
            tokens = merge_feature_shards(out, parts, [sample_key(r) for r in rows])
            entry = shard_entry(name, out, rows=len(rows), tokens=tokens, split=shard.split, layer_ids=layer_ids,
                                dtype=cfg.extract.dtype)
    _clear_parts(store, fp, name)
    log.info("extracted %s: %d sequences, %d tokens, taps %s, %s", name, len(rows), tokens, layer_ids,
             cfg.extract.dtype)
    return shard_result(entry, None, len(rows), len(rows), {})


def bad_shards(store: Store, fp: str, shards: Iterable[ShardEntry], checksum: bool = True) -> list[str]:
    """Names of feature shards that are missing, of the wrong size, or (with `checksum`)
    whose sha256 differs from their manifest entry.

    Each shard is read once when hashed, streamed (local file or S3 object); nothing is
    cached. Without `checksum` only sizes are read: what reusing a complete stage checks,
    since hashing terabytes on every run costs a full read (a download on S3); the train
    stage hashes each shard it reads, so a same-size corruption is still caught there.
    """
    bad = []
    for s in shards:
        path = store.stage_path(STAGE, fp, s.name)
        if not store.exists(path) or store.fs.size(path) != s.bytes or \
                (checksum and sha256_of(path, fs=store.fs) != s.sha256):
            log.warning("feature shard %s is missing, truncated or corrupted; it will be recomputed", s.name)
            bad.append(s.name)
    return bad


def drop_manifest_if_damaged(store: Store, fp: str) -> None:
    """Before a complete stage is reused: a missing or wrong-size feature shard removes the manifest,
    so the stage runs again and recomputes that shard only (the others come back from the cache)."""
    manifest = store.read_manifest(STAGE, fp)
    if manifest is not None and bad_shards(store, fp, manifest.shards, checksum=False):
        store.fs.rm(store.stage_path(STAGE, fp, MANIFEST))


# ----------------------------------------------------------------------------- online mode


def check_online(cfg: RunConfig) -> None:
    """Online mode needs the hf capture engine on the training device (the target is co-located)."""
    if cfg.extract.mode != "online":
        return
    if cfg.extract.engine != "hf":
        raise ConfigError("extract.mode=online computes features inside training: set extract.engine=hf")
    same = {"cuda": "cuda:0"}
    if same.get(t := resolve_device(cfg.target.device), t) != same.get(d := resolve_device(cfg.train.device), d):
        raise ConfigError(f"extract.mode=online needs the target on the training device: target.device="
                          f"{cfg.target.device} but train.device={cfg.train.device}; set them equal")


def online_manifest(store: Store, stamp: Stamp, cfg: RunConfig, tokenized: StageResult) -> Manifest:
    """The extract stage in online mode: no feature shard, the tokenize train shards to read instead."""
    check_online(cfg)
    shards = tokenized.manifest.data_shards("train")
    rows, tokens = sum(s.rows for s in shards), sum(s.tokens for s in shards)
    result = ShardResult(shard=None, rows_in=rows, rows_out=rows)
    sequences = {"stage": tokenized.stage, "fingerprint": tokenized.fingerprint,
                 "shards": [s.to_json() for s in shards]}
    extra = {"mode": "online", "tokens": tokens, "sequences": sequences}
    return finalize(store, stamp, [result], extra=carry(tokenized.manifest, extra))
