"""Train stage: feature shards -> a drafter checkpoint (DFlash, or EAGLE-3 with `drafter.kind: eagle3`).

EAGLE-3 also chooses its draft vocabulary (d2t/t2d) from the token counts of the tokenize
stage that fed extract (`draftflow.training.job.draft_vocab`); its feature shards hold the
target's final normed state too.

What runs training is the training package: `draftflow.training.job.train_here` in this
process, or the same function in every torchrun rank (`draftflow.training.launch`); this
module decides where, then commits the outputs.

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
import socket
from pathlib import Path
from typing import Any

from draftflow.compat import importing_transformers
from draftflow.config import RunConfig, VLLMEngineConfig
from draftflow.contracts import FeatureSource, Manifest, OnlineFeatures, ShardEntry, ShardResult, Stamp
from draftflow.drafters.export import TRAINED_ON_NAME, write_trained_on
from draftflow.drafters.registry import drafter_spec
from draftflow.export_readme import ROOT_PLACEHOLDER, portable_target_name, serve_command, speculative_settings
from draftflow.feature_stream import open_features
from draftflow.kept import default_cache_dir
from draftflow.stages.common import finalize
from draftflow.store import Store, shard_entry
from draftflow.target import TargetRef
from draftflow.training.checkpoint import CKPT_DIR
from draftflow.training.job import Trained, token_counts, train_here
from draftflow.training.launch import use_torchrun
from draftflow.training.metrics import write_metrics
from draftflow.training.mirror import pull_checkpoint

log = logging.getLogger(__name__)
STAGE = "train"
CHECKPOINT_FILES = ("model.safetensors", "config.json", "metrics.json")
EXPORT_FORMATS = ("vllm", "speculators")  # serving exports, under export/<format>/


def work_dir(store: Store, fp: str) -> str:
    """Where training runs: in the stage folder on a local root, else under this node's cache directory."""
    if store.is_local:
        return store.stage_path(STAGE, fp, "work")
    key = hashlib.sha256(store.stage_path(STAGE, fp).encode()).hexdigest()[:16]
    return str(default_cache_dir() / "train-work" / key)


def launch_url(store: Store, fp: str) -> str:
    """A remote root's launch folder in the store: the spec every node's torchrun reads, results, errors."""
    return store.url(store.stage_path(STAGE, fp, "work", "launch"))


def run(store: Store, stamp: Stamp, cfg: RunConfig, target: TargetRef, features: FeatureSource) -> Manifest:
    """Train the drafter on every train feature shard (or online features); return the stage manifest.

    In this process (`draftflow.training.job.train_here`), or in torchrun child processes
    (`draftflow.training.launch.use_torchrun`); the manifest is written here, last, only after
    training succeeded.
    """
    fp = stamp.fingerprint
    out = work_dir(store, fp)
    mirror = checkpoint_mirror(store, fp)
    if mirror:
        pull_checkpoint(store, mirror, out)
    trained = (train_in_children if use_torchrun(cfg.train) else train_here)(store, cfg, target, features, out,
                                                                             mirror)
    metrics, tokens = trained.metrics, trained.tokens
    entries = [commit_file(store, fp, out, name, f"checkpoint/{name}") for name in CHECKPOINT_FILES]
    exports = {fmt: f"export/{fmt}" for fmt in EXPORT_FORMATS}  # relative to the stage folder, as every path here
    # Exports and metrics are listed under extra.files, not shards: evaluate loads every shard as the drafter.
    # Relative to the run's root: the READMEs (hashed into this manifest, so into evaluate's fingerprint) must
    # not depend on where the root lives; the serve lines the CLI prints carry the absolute path.
    served_from = {fmt: f"{ROOT_PLACEHOLDER}/{STAGE}/{fp}/{rel}" for fmt, rel in exports.items()}
    written = write_outputs(out, metrics, trained.target_config, portable_target_name(cfg.target.path, target.path),
                            cfg.drafter.kind, served_from, trained_on(cfg, target.fingerprint))
    files = [commit_file(store, fp, out, f, f).to_json() for f in written]
    results = [ShardResult(shard=None, rows_in=trained.rows, rows_out=trained.rows)]
    results += [ShardResult(shard=e, rows_in=0, rows_out=0) for e in entries]
    extra = {"checkpoint": "checkpoint", "metrics": metrics, "trained_tokens": tokens, "features": cfg.extract.mode,
             "export": exports, "files": files}
    if cfg.train.init_from:  # the warm start, and whether the target changed since that drafter was trained
        from draftflow.training.warm import manifest_note, resolve

        extra["init_from"] = manifest_note(resolve(cfg.root, cfg.train.init_from), target.fingerprint)
    manifest = finalize(store, stamp, results, extra=extra)
    # The stage is complete: its resume copies (checkpoints, the launch folder) are no longer needed.
    if mirror and store.fs.exists(store.stage_path(STAGE, fp, "work")):
        store.fs.rm(store.stage_path(STAGE, fp, "work"), recursive=True)
    if not store.is_local:  # the local work folder of a remote root (finalize removed a local root's)
        shutil.rmtree(out, ignore_errors=True)
    return manifest


# ----------------------------------------------------------------------------- where training runs


def train_in_children(store: Store, cfg: RunConfig, target: TargetRef, features: FeatureSource,
                      out: str, mirror: str | None = None) -> Trained:
    """Train in `train.nproc_per_node` torchrun processes on this node (see `draftflow.training.launch`).

    The spec names the store root, the features manifest (its shards: feature files, or the
    tokenize rows of online mode), the resolved config, the target and the work folder.
    Remote inputs are downloaded and verified here once, so the ranks find them cached.
    """
    with importing_transformers():
        from transformers import AutoConfig

    from draftflow.training.launch import launch_training

    if not store.is_local:
        prefetch_inputs(store, cfg, features)
    release_gpu_models()
    spec = {"config": cfg.model_dump(mode="json"), "target": {"path": target.path, "fingerprint": target.fingerprint},
            "features": features.model_dump(mode="json"), "out_dir": out, "mirror": mirror}
    if mirror and cfg.train.nnodes > 1:  # nodes share only the store: the launch folder is there, work folders not
        fp = mirror.split("/")[-3]  # <root>/train/<fp>/work/checkpoints
        spec |= {"exchange": launch_url(store, fp), "node_work": str(Path(out).relative_to(default_cache_dir())),
                 "first_node": socket.gethostname()}
    result = launch_training(spec, cfg.train, out)
    target_config = AutoConfig.from_pretrained(str(Path(out) / "launch" / "target"))  # rank 0's, as loaded there
    return Trained(result["metrics"], target_config, result["rows"], result["tokens"])


# ----------------------------------------------------------------------------- checkpoints on remote roots
# On an s3:// root each checkpoint is also copied into the store (`draftflow.training.mirror`).


def checkpoint_mirror(store: Store, fp: str) -> str | None:
    """Where checkpoints of this train stage are copied in the store (None: local root, no copy)."""
    return None if store.is_local else store.stage_path(STAGE, fp, "work", CKPT_DIR)


def release_gpu_models() -> None:
    """Free what earlier stages left on this process's GPU (a cached target, a vLLM capture
    engine holding `gpu_memory_utilization` of it) before the ranks take the same GPUs."""
    from draftflow.engines.capture import release_capture_engines
    from draftflow.target import release_targets

    release_capture_engines()
    release_targets()


def prefetch_inputs(store: Store, cfg: RunConfig, features: FeatureSource) -> None:
    """Download (and checksum) every input shard of training into the local cache; feature shards with
    per-sample checksums are only opened (their indexes read): the ranks stream them (`draftflow.feature_stream`)."""
    if isinstance(features, OnlineFeatures):
        for s in features.shards:
            store.verify_sha(features.stage, features.fingerprint, s)
    else:
        open_features(store, features.stage, features.fingerprint, features.shards)
    if drafter_spec(cfg.drafter.kind).draft_vocab:
        token_counts(store, features)


def commit_file(store: Store, fp: str, out: str, local: str, name: str) -> ShardEntry:
    """Copy `out/local` to `train/<fp>/<name>` atomically; return its manifest entry (bytes, sha256)."""
    with store.writing(store.stage_path(STAGE, fp, *name.split("/"))) as tmp:
        Path(tmp).write_bytes((Path(out) / local).read_bytes())
        return shard_entry(name, tmp, rows=0)


def trained_on(cfg: RunConfig, target_fingerprint: str) -> dict[str, Any]:
    """What each export records of its training (`draftflow.drafters.export.TRAINED_ON_NAME`): the features' storage
    dtype and mode, so an evaluation of the export alone rounds its features as they were in training; the target's
    fingerprint, so a warm start from it (`train.init_from`) and `draftflow status` see a newer target revision."""
    return {"extract_dtype": cfg.extract.dtype, "features": cfg.extract.mode, "drafter": cfg.drafter.kind,
            "target": target_fingerprint}


def write_outputs(out: str, metrics: dict[str, Any], target_config: Any, target_name: str,
                  kind: str = "dflash", served_from: dict[str, str] | None = None,
                  training: dict[str, Any] | None = None) -> list[str]:
    """Metrics files and both serving exports (of `kind`) of the trained drafter in `out`; paths relative to it.

    Args:
        target_name: the target's portable name (`draftflow.export_readme.portable_target_name`).
        served_from: per format, where the export will be served from (its store URL) for its README.
        training: written into each export as `draftflow.drafters.export.TRAINED_ON_NAME` (`trained_on`); none if None.
    """
    spec = drafter_spec(kind)
    exports = []
    for fmt in EXPORT_FORMATS:
        folder = Path(out) / "export" / fmt
        spec.exporters[fmt](out, folder, target_config, target_name=target_name,
                            served_from=(served_from or {}).get(fmt))
        names = list(spec.export_files(fmt))
        if training is not None:
            write_trained_on(folder, training)
            names.append(TRAINED_ON_NAME)
        exports += [f"export/{fmt}/{name}" for name in names]
    return write_metrics(out, metrics) + exports


def serve_lines(store: Store, trained: Manifest, target: str, dtype: str = "auto",
                vcfg: VLLMEngineConfig | None = None, choice: dict[str, Any] | None = None) -> dict[str, str]:
    """Per export format of a complete train stage, the line that serves its export where the store holds
    it, with the target as this machine loaded it (`target`), the dtype vLLM measured it in and, where
    draftflow's engines run eagerly (`vcfg`, e.g. on a CPU build), `--enforce-eager`, through an interpreter
    that imports vLLM (`vllm_python`), so the line runs here as printed and as evaluate measured it.
    Made when asked, not kept in the manifest: the target's local path is this machine's, not the run's.

    `choice`: evaluate's serve settings chosen from measured costs (`serve_choice` of its manifest): the lines
    carry batch 1's number of drafts (`serve_choice.advice` says what was chosen, beside them)."""
    from draftflow.engines.vllm import eager_mode, stored_dtype

    eager = eager_mode(vcfg or VLLMEngineConfig())
    lines = {}
    for fmt, rel in trained.extra.get("export", {}).items():
        folder = store.stage_path(STAGE, trained.fingerprint, rel)
        method, drafts = speculative_settings(store.read_json(f"{folder}/config.json"))
        lines[fmt] = serve_command(target, store.url(folder), method, _chosen_drafts(choice, drafts),
                                   dtype=stored_dtype(target, dtype), python=vllm_python(), eager=eager)
    return lines


def _chosen_drafts(choice: dict[str, Any] | None, drafts: int) -> int:
    """Batch 1's chosen number of drafts when it is the drafter's, else the export's own."""
    setting = ((choice or {}).get("1") or {}).get("setting", "")
    return int(setting.rsplit("=", 1)[1]) if ":k=" in setting and not setting.startswith("ngram") else drafts


def vllm_python() -> str:
    """An interpreter that imports vLLM: this one if it does, else the project's `.venv-vllm` (where
    `make rehearsal` and `make test-vllm` install vLLM's CPU build) when it is in the working directory,
    else `python`."""
    import importlib.util
    import sys

    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    local = Path(".venv-vllm") / "bin" / "python"
    return str(local.absolute()) if local.is_file() else "python"  # not resolve(): a venv python is a link
