"""Train stage: feature shards -> a drafter checkpoint (DFlash, or EAGLE-3 with `drafter.kind: eagle3`).

EAGLE-3 also chooses its draft vocabulary (d2t/t2d) from the token counts of the tokenize
stage that fed extract (`draft_vocab`); its feature shards hold the target's final normed state too.

Training runs in a local work folder (`<root>/train/<fp>/work` for a local
root) that keeps periodic checkpoints, so a crashed run resumes from its last
checkpoint with the same result as an uninterrupted one. The final weights,
config and metrics are then committed atomically under `checkpoint/`, and the
manifest is written last.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from draftflow.checkpoint import CKPT_DIR, KEEP_CHECKPOINTS, latest_checkpoint
from draftflow.config import RunConfig
from draftflow.errors import ConfigError
from draftflow.export import (
    export_eagle3_speculators,
    export_eagle3_vllm,
    export_files,
    export_speculators,
    export_vllm_dflash,
)
from draftflow.export_readme import portable_target_name, serve_command_for
from draftflow.features import STORED, FeatureSample, load_samples, round_trip
from draftflow.launch import use_torchrun
from draftflow.metrics import write_metrics
from draftflow.models.dflash import DFlashConfig
from draftflow.models.eagle3 import Eagle3Config
from draftflow.stages.common import data_shards, finalize
from draftflow.store import Store, default_cache_dir, shard_entry
from draftflow.target import TargetRef, load_target

log = logging.getLogger(__name__)
STAGE = "train"
CHECKPOINT_FILES = ("model.safetensors", "config.json", "metrics.json")
EXPORT_FORMATS = ("vllm", "speculators")  # serving exports, under export/<format>/


def mask_token_id(tokenizer) -> int:
    """The tokenizer's mask token, else `len(tokenizer)` (DFlash; Qwen3 gives 151669)."""
    return tokenizer.mask_token_id if tokenizer.mask_token_id is not None else len(tokenizer)


def check_taps(dcfg: DFlashConfig | Eagle3Config, shards: list[dict[str, Any]]) -> None:
    """The drafter's taps (EAGLE-3: and the final state, id -1) must be the ones the features were extracted at."""
    for s in shards:
        if list(s["layer_ids"]) != dcfg.feature_ids:
            raise ConfigError(
                f"feature shard {s['name']} holds taps {s['layer_ids']} but the drafter wants "
                f"{dcfg.feature_ids}; re-run extract with the same drafter.kind and drafter.target_layer_ids"
            )


def token_counts(store: Store, features: dict[str, Any]) -> str:
    """Local, checksum-verified path of `token_freq.parquet` of the tokenize stage the features came from.

    Raises:
        ConfigError: the extract manifest does not name its tokenize stage, or that stage has no counts.
    """
    m = features["manifest"]
    if m["extra"].get("mode") == "online":
        fps = {m["extra"]["tokenize"]["fingerprint"]}
    else:
        fps = {s.get("tokenize_fingerprint") for s in data_shards(m, "train")}
    tm = store.read_manifest("tokenize", next(iter(fps))) if len(fps) == 1 and None not in fps else None
    entry = next((e for e in (tm or {}).get("shards", []) if e.get("kind") == "freq"), None)
    if entry is None:
        raise ConfigError(f"drafter.kind=eagle3 needs the tokenize stage's token_freq.parquet, but the features "
                          f"name tokenize stage(s) {sorted(map(str, fps))} without one; re-run tokenize and extract")
    return store.verify_sha("tokenize", next(iter(fps)), entry)


def draft_vocab(store: Store, features: dict[str, Any], size: int,
                vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d): the `size` most frequent supervised tokens counted by tokenize, for a target
    vocabulary of `vocab_size`. Chosen here, not in tokenize, so `drafter.draft_vocab_size` is a
    train setting: changing it re-runs training only, never extract."""
    from collections import Counter

    from draftflow.data.schema import read_rows
    from draftflow.stages.tokenize import draft_vocab as top_tokens

    counts = Counter({r["token_id"]: r["count"] for r in read_rows(token_counts(store, features))})
    d2t, t2d = top_tokens(counts, vocab_size, size)
    return torch.tensor(d2t, dtype=torch.int64), torch.tensor(t2d, dtype=torch.bool)


def drafter_config(store: Store, cfg: RunConfig, model, tokenizer, features: dict[str, Any]):
    """(the drafter config of `drafter.kind`, the draft vocabulary for EAGLE-3 else None)."""
    if cfg.drafter.kind == "eagle3":
        d2t, t2d = draft_vocab(store, features, cfg.drafter.draft_vocab_size, model.config.vocab_size)
        return Eagle3Config.from_target(model.config, cfg.drafter, d2t.numel()), (d2t, t2d)
    return DFlashConfig.from_target(model.config, cfg.drafter, mask_token_id(tokenizer)), None


def work_dir(store: Store, fp: str) -> str:
    if store.is_local:
        return store.stage_path(STAGE, fp, "work")
    key = hashlib.sha256(store.stage_path(STAGE, fp).encode()).hexdigest()[:16]
    return str(default_cache_dir() / "train-work" / key)


def run(store: Store, fp: str, cfg: RunConfig, target: TargetRef, inputs: dict[str, str],
        features: dict[str, Any]) -> dict[str, Any]:
    """Train the drafter on every train feature shard (or online features); return the stage manifest.

    In this process, or in torchrun child processes (`draftflow.launch.use_torchrun`); the
    manifest is written here, last, only after training succeeded.
    """
    out = work_dir(store, fp)
    mirror = checkpoint_mirror(store, fp)
    if mirror:
        pull_checkpoint(store, mirror, out)
    trained = (train_in_children if use_torchrun(cfg.train) else train_here)(store, cfg, target, features, out,
                                                                             mirror)
    metrics, tokens = trained.metrics, trained.tokens
    entries = [commit_file(store, fp, out, name, f"checkpoint/{name}") for name in CHECKPOINT_FILES]
    exports = {fmt: store.url(store.stage_path(STAGE, fp, "export", fmt)) for fmt in EXPORT_FORMATS}
    # Exports and metrics are listed under extra.files, not shards: evaluate loads every shard as the drafter.
    written = write_outputs(out, metrics, trained.target_config, portable_target_name(cfg.target.path, target.path),
                            cfg.drafter.kind, exports)
    files = [commit_file(store, fp, out, f, f) for f in written]
    result = {"shard": None, "rejected": None, "rows_in": trained.rows, "rows_out": trained.rows, "dropped": {}}
    manifest_results = [result] + [{"shard": e | {"tokens": 0}, "rejected": None, "rows_in": 0, "rows_out": 0,
                                    "dropped": {}} for e in entries]
    extra = {"checkpoint": store.url(store.stage_path(STAGE, fp, "checkpoint")), "metrics": metrics,
             "trained_tokens": tokens, "features": cfg.extract.mode,
             "export": exports, "serve": serve_lines(out, target.path, exports), "files": files}
    manifest = finalize(store, STAGE, fp, cfg, inputs, manifest_results, extra=extra)
    if mirror and store.fs.exists(mirror):  # the stage is complete: its resume copies are no longer needed
        store.fs.rm(mirror, recursive=True)
    return manifest


# ----------------------------------------------------------------------------- where training runs


@dataclass
class Trained:
    """What the stage needs from a finished training run."""

    metrics: dict[str, Any]
    target_config: Any  # the target's HF config, as loaded for training (exports read it)
    rows: int  # training sequences
    tokens: int  # their tokens


def train_here(store: Store, cfg: RunConfig, target: TargetRef, features: dict[str, Any], out: str,
               mirror: str | None = None) -> Trained:
    """Load the target, the drafter config and the samples, and train in this process.

    The in-process path, and what each torchrun rank runs (`draftflow.launch`). With
    `mirror` (remote roots), every checkpoint is also copied there (`push_checkpoint`).
    """
    from draftflow.train import train_drafter

    model, tokenizer = load_target(target.path, cfg.target.dtype, cfg.target.device)
    dcfg, vocab = drafter_config(store, cfg, model, tokenizer, features)
    samples, tokens = training_samples(store, cfg, target, dcfg, features)
    push = (lambda folder: push_checkpoint(store, mirror, folder)) if mirror else None
    metrics = train_drafter(samples, model, dcfg, cfg.train, out, draft_vocab=vocab, on_checkpoint=push)
    return Trained(metrics, model.config, len(samples), tokens)


def train_in_children(store: Store, cfg: RunConfig, target: TargetRef, features: dict[str, Any],
                      out: str, mirror: str | None = None) -> Trained:
    """Train in `train.nproc_per_node` torchrun processes on this node (see `draftflow.launch`).

    The spec names the store root, the features manifest (its shards: feature files, or the
    tokenize rows of online mode), the resolved config, the target and the work folder.
    Remote inputs are downloaded and verified here once, so the ranks find them cached.
    """
    from transformers import AutoConfig

    from draftflow.launch import launch_training

    if not store.is_local:
        prefetch_inputs(store, cfg, features)
    release_gpu_models()
    spec = {"config": cfg.model_dump(mode="json"), "target": {"path": target.path, "fingerprint": target.fingerprint},
            "features": features, "out_dir": out, "mirror": mirror}
    result = launch_training(spec, cfg.train, out)
    target_config = AutoConfig.from_pretrained(str(Path(out) / "launch" / "target"))  # rank 0's, as loaded there
    return Trained(result["metrics"], target_config, result["rows"], result["tokens"])


# ----------------------------------------------------------------------------- checkpoints on remote roots
# On an s3:// root the work folder is on the worker's local disk; a retry on another pod or
# machine would start from step 0. Each checkpoint is therefore copied under
# `train/<fp>/work/checkpoints/step_N/` in the store, its `COMPLETE` marker last, and the
# newest complete one is pulled back before training when it is newer than any local one.
MIRROR_DONE = "COMPLETE"


def checkpoint_mirror(store: Store, fp: str) -> str | None:
    """Where checkpoints of this train stage are copied in the store (None: local root, no copy)."""
    return None if store.is_local else store.stage_path(STAGE, fp, "work", CKPT_DIR)


def _remote_steps(store: Store, mirror: str) -> list[str]:
    """Complete remote checkpoint folders, oldest first."""
    if not store.fs.exists(mirror):
        return []
    found = sorted(p.rstrip("/") for p in store.fs.ls(mirror, detail=False) if p.rstrip("/").split("/")[-1]
                   .startswith("step_"))
    return [p for p in found if store.fs.exists(f"{p}/{MIRROR_DONE}")]


def push_checkpoint(store: Store, mirror: str, folder: Path) -> None:
    """Copy a complete local checkpoint folder to the store (marker last), keeping the newest few."""
    dest = f"{mirror}/{folder.name}"
    for f in sorted(folder.iterdir()):
        store.fs.put_file(str(f), f"{dest}/{f.name}")
    store.fs.pipe_file(f"{dest}/{MIRROR_DONE}", b"")
    for old in _remote_steps(store, mirror)[:-KEEP_CHECKPOINTS]:
        store.fs.rm(old, recursive=True)


def pull_checkpoint(store: Store, mirror: str, out: str) -> Path | None:
    """Fetch the newest complete remote checkpoint into `out/checkpoints` if newer than the local ones."""
    remote = _remote_steps(store, mirror)
    local = latest_checkpoint(out)
    if not remote or (local is not None and local.name >= remote[-1].split("/")[-1]):
        return None
    name = remote[-1].split("/")[-1]
    root = Path(out) / CKPT_DIR
    tmp, final = root / f".tmp_{name}", root / name
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in store.fs.ls(remote[-1], detail=False):
        if not f.endswith(MIRROR_DONE):
            store.fs.get_file(f, str(tmp / f.rstrip("/").split("/")[-1]))
    tmp.rename(final)
    log.info("resuming from the checkpoint copied to the store: %s", store.url(remote[-1]))
    return final


def release_gpu_models() -> None:
    """Free what earlier stages left on this process's GPU (a cached target, a vLLM capture
    engine holding `gpu_memory_utilization` of it) before the ranks take the same GPUs."""
    from draftflow.capture import release_capture_engines
    from draftflow.target import release_targets

    release_capture_engines()
    release_targets()


def prefetch_inputs(store: Store, cfg: RunConfig, features: dict[str, Any]) -> None:
    """Download (and checksum) every input shard of training into the local cache."""
    m = features["manifest"]
    if m["extra"].get("mode") == "online":
        tok = m["extra"]["tokenize"]
        for s in tok["shards"]:
            store.verify_sha("tokenize", tok["fingerprint"], s)
    else:
        for s in data_shards(m, "train"):
            store.verify_sha("extract", features["fingerprint"], s)
    if cfg.drafter.kind == "eagle3":
        token_counts(store, features)


def commit_file(store: Store, fp: str, out: str, local: str, name: str) -> dict[str, Any]:
    """Copy `out/local` to `train/<fp>/<name>` atomically; return its manifest entry (bytes, sha256)."""
    with store.writing(store.stage_path(STAGE, fp, *name.split("/"))) as tmp:
        Path(tmp).write_bytes((Path(out) / local).read_bytes())
        return shard_entry(name, tmp, rows=0)


EXPORTERS = {"dflash": {"vllm": export_vllm_dflash, "speculators": export_speculators},
             "eagle3": {"vllm": export_eagle3_vllm, "speculators": export_eagle3_speculators}}


def write_outputs(out: str, metrics: dict[str, Any], target_config: Any, target_name: str,
                  kind: str = "dflash", served_from: dict[str, str] | None = None) -> list[str]:
    """Metrics files and both serving exports (of `kind`) of the trained drafter in `out`; paths relative to it.

    Args:
        target_name: the target's portable name (`draftflow.export_readme.portable_target_name`).
        served_from: per format, where the export will be served from (its store URL) for its README.
    """
    for fmt in EXPORT_FORMATS:
        EXPORTERS[kind][fmt](out, Path(out) / "export" / fmt, target_config, target_name=target_name,
                             served_from=(served_from or {}).get(fmt))
    exports = [f"export/{fmt}/{name}" for fmt in EXPORT_FORMATS for name in export_files(kind, fmt)]
    return write_metrics(out, metrics) + exports


def serve_lines(out: str, target: str, exports: dict[str, str]) -> dict[str, str]:
    """Per format, the `vllm serve` line of the export written in `out`, served from `exports[fmt]`,
    with the target as this machine loaded it (`target`), so the line runs here as printed."""
    return {fmt: serve_command_for(Path(out) / "export" / fmt, target, url) for fmt, url in exports.items()}


def training_samples(store: Store, cfg: RunConfig, target: TargetRef, dcfg: DFlashConfig | Eagle3Config,
                     features: dict[str, Any]) -> tuple[Any, int]:
    """(samples, their tokens): stored feature shards, or an `OnlineSamples` source in online mode."""
    m = features["manifest"]
    if m["extra"].get("mode") == "online":
        tok = m["extra"]["tokenize"]
        paths = [store.verify_sha("tokenize", tok["fingerprint"], s) for s in tok["shards"]]
        samples = OnlineSamples.from_parquet(paths, target, cfg, dcfg.feature_ids)
        return samples, samples.tokens
    shards = data_shards(m, "train")
    check_taps(dcfg, shards)
    samples = load_samples([store.verify_sha("extract", features["fingerprint"], s) for s in shards])
    return samples, sum(int(s.input_ids.numel()) for s in samples)


# ----------------------------------------------------------------------------- online mode


class OnlineSamples:
    """Training sequences whose features are computed per step by the co-located target.

    Holds the tokenize rows as Arrow columns (ids and masks, no features). `take`
    runs extract's capture engine over one step's sequences and rounds the result
    through the storage format, so it returns what `FeatureShard.get` would.
    """

    def __init__(self, table: pa.Table, engine, dtype: str, batch_size: int):
        self.table, self.engine, self.dtype, self.batch_size = table, engine, dtype, batch_size
        self.sample_ids = [f"{s}:{r}" for s, r in zip(table["sample_id"].to_pylist(), table["row"].to_pylist())]
        self.tokens = int(pc.sum(pc.list_value_length(table["input_ids"])).as_py() or 0)

    @classmethod
    def from_parquet(cls, paths: list[str], target: TargetRef, cfg: RunConfig, layer_ids: list[int]) -> OnlineSamples:
        from draftflow.capture import make_capture_engine

        cols = ["sample_id", "row", "input_ids", "loss_mask"]
        table = pa.concat_tables([pq.read_table(p, columns=cols) for p in paths])
        engine = make_capture_engine("hf", target.path, list(layer_ids), cfg.target.dtype, cfg.target.device)
        return cls(table, engine, cfg.extract.dtype, cfg.extract.batch_size)

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, i: int) -> FeatureSample:
        return self.take([i])[0]

    def take(self, indices: list[int]) -> list[FeatureSample]:
        """The samples at `indices`, features captured in length-sorted batches of `extract.batch_size`."""
        from draftflow.capture import capture_in_batches

        rows = self.table.take(pa.array(indices, type=pa.int64())).to_pylist()
        feats, self.batch_size = capture_in_batches(self.engine, [r["input_ids"] for r in rows], self.batch_size)
        return [FeatureSample(self.sample_ids[i], torch.tensor(r["input_ids"], dtype=torch.int64),
                              torch.tensor(r["loss_mask"], dtype=torch.bool), as_stored(f, self.dtype))
                for i, r, f in zip(indices, rows, feats)]


def as_stored(feats: torch.Tensor, dtype: str) -> torch.Tensor:
    """(T, n_taps, D) features as a reader of an `extract.dtype` shard gets them (fp8: dequantized bf16)."""
    reader = torch.bfloat16 if dtype == "float8" else STORED[dtype]
    return round_trip(feats, dtype, feats.shape[1]).to(reader)
