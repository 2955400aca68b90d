"""What a run would do, without running it: state, sizes, space and time per stage.

Walks the stages in order: a stage's fingerprint is known once its inputs'
manifests exist, so `draftflow plan` shows "complete" for reusable stages,
"to run" for the first stage that would run, and "waits" after it. Also the
preflight checks every run passes first, and extract's space check (`check_space`).

Sizes and times come from `draftflow.stages.estimate` (measured from a complete stage's
manifest, else estimated from its upstream and the config). It never loads weights.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from draftflow.codehash import ROOT, closure, library_versions, source_hash
from draftflow.config import RunConfig
from draftflow.contracts import Manifest
from draftflow.drafters.taps import check_drafter, feature_ids
from draftflow.errors import ConfigError, DraftflowError
from draftflow.kept import kept_answer
from draftflow.runs.runstate import stage_states
from draftflow.stages.curate import check_sources
from draftflow.stages.estimate import (
    CHARS_PER_TOKEN,
    assumptions,
    feature_bytes,
    hardware,
    model_shape,
    source_estimate,
    target_config,
)
from draftflow.stages.extract import check_online
from draftflow.stages.regenerate import check_engine
from draftflow.stages.registry import maker, spec, stage_names
from draftflow.store import Store
from draftflow.target import TargetRef, check_target_files, resolve_target

log = logging.getLogger(__name__)
# Below this, a root cannot hold even curate's shards and the run's records: stop before any work.
MIN_FREE_BYTES = 64 << 20
# One conversation every chat template must render (system prompts and tools are optional in templates).
PROBE_CONVERSATION = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}]


def preflight(cfg: RunConfig) -> TargetRef:
    """Fail fast, before any work and without writing, on anything that can be checked up front: the
    drafter section, the run root (writable, with space), each source file (reachable, its format sniffed),
    the curate tokenizer, the target (config, weights' headers, tokenizer, one conversation rendered with
    its chat template), taps, engines. Each failure is a one-line `DraftflowError` naming what to fix."""
    check_drafter(cfg.drafter)  # target-free: kind, tap count, layer types (one line each)
    check_root(cfg.root)
    check_sources(cfg.curate)
    _check_curate_tokenizer(cfg)
    target = resolve_target(cfg.target)
    if Path(target.path).is_dir():  # a hub id is checked when it is downloaded
        check_target_files(target.path)
    _check_taps(cfg, target)
    _check_chat(cfg, target)
    check_engine(cfg, target)
    check_online(cfg)
    check_vllm(cfg, target)
    from draftflow.runs.gating import check_gate

    check_gate(cfg)  # a named evaluate.gate.baseline exists
    from draftflow.evaluation.compare_with import check_compare_with

    check_compare_with(cfg.root, cfg.evaluate.compare_with, target.fingerprint, target.path)  # exist, same target
    if cfg.train.init_from:  # the drafter a warm start names is there (its fit is checked when training loads it)
        from draftflow.training.warm import resolve

        resolve(cfg.root, cfg.train.init_from)
    from draftflow.evaluation.selection import check_categories

    check_categories(cfg.curate, cfg.evaluate)  # evaluate.categories names ones a source can give
    return target


def check_root(root: str, free=None) -> None:
    """The run root can be written: a known protocol; locally, its nearest existing folder is a writable
    folder with at least MIN_FREE_BYTES free; an object store answers a listing of it (writes are checked by the run
    lock). Writes nothing."""
    if "://" in root and not root.startswith("file://"):
        import fsspec

        try:
            fs, path = fsspec.core.url_to_fs(root)
        except (ValueError, ImportError) as exc:  # unknown protocol, or its package is not installed
            raise ConfigError(f"root {root}: {exc}; use a local folder or s3://bucket/prefix") from None
        _list_remote(root, fs, path)
        return
    path = Path(root.removeprefix("file://")).expanduser().absolute()
    near = next(p for p in (path, *path.parents) if p.exists())
    if not near.is_dir():
        raise ConfigError(f"root {root}: {near} is a file, not a folder; choose another root")
    if not os.access(near, os.W_OK | os.X_OK):
        raise ConfigError(f"root {root} is not writable ({near} refuses this user, or is read-only); "
                          "fix its permissions or choose another root")
    avail = (free or free_space)(root)
    if avail is not None and avail < MIN_FREE_BYTES:
        raise ConfigError(f"root {root} has {human_bytes(avail)} free (a run needs at least "
                          f"{human_bytes(MIN_FREE_BYTES)} before extract's features); free space or move root")


def _list_remote(root: str, fs, path: str) -> None:
    """List the root once. A request with a body tells why S3 refuses (InvalidAccessKeyId, SignatureDoesNotMatch,
    AccessDenied, NoSuchBucket); the HEAD requests a run starts with get a bare 403 that cannot tell a wrong key
    from a bucket policy."""
    from draftflow.store import storage_cause, storage_error_message

    try:
        fs.ls(path, detail=False)
    except Exception as exc:  # noqa: BLE001  (storage's own exceptions: OSErrors and botocore's)
        if storage_cause(exc) in ("credentials", "permission"):  # what the user must fix; the rest (a new prefix,
            raise ConfigError(storage_error_message(exc, root)) from None  # a 5xx) is the run's to meet


def _check_curate_tokenizer(cfg: RunConfig) -> None:
    """`curate.tokenizer` (when set) loads: a local folder that exists, with tokenizer files."""
    name = cfg.curate.tokenizer
    if name is None:
        return
    if name.startswith((".", "/", "~")) and not Path(name).expanduser().is_dir():
        raise ConfigError(f"curate.tokenizer {name} is not a folder; give a tokenizer folder or an HF model id")
    from draftflow.data.filters import load_tokenizer

    try:
        load_tokenizer(name)
    except Exception as exc:  # transformers raises OSError, ValueError or the tokenizers library's own errors
        raise ConfigError(f"curate.tokenizer {name} cannot be loaded ({' '.join(str(exc).split())[:300]}); "
                          "point it at a folder with tokenizer files or an HF model id") from None


def check_vllm(cfg: RunConfig, target: TargetRef) -> None:
    """When a stage uses vLLM: it imports, and (on CPU) supports the target's head size. One line each."""
    stages = [name for name, engine in (("regenerate", cfg.regenerate.engine), ("extract", cfg.extract.engine),
                                        ("evaluate", cfg.evaluate.engine)) if engine == "vllm"]
    if not stages:
        return
    from draftflow.engines.vllm import check_head_size, import_vllm

    try:
        import_vllm()
    except DraftflowError as exc:
        raise ConfigError(f"{', '.join(s + '.engine' for s in stages)}=vllm: {exc}") from None
    check_head_size(target.path)


@functools.cache
def _checking_code() -> str:
    """What `_once`'s answers depend on beside the target: transformers' and tokenizers' versions and the code of
    this module and all it imports (read once per process, not once per check)."""
    code = source_hash(ROOT, closure(ROOT, __name__), extra_dirs=())
    return f"{library_versions(('transformers', 'tokenizers'))} {code}"


def _once(target: TargetRef, what: str, check: Callable[[], str]) -> str:
    """`check()`'s answer, kept under the cache directory (`preflight/`) for a local target: the target's tokenizer
    or config loaded through transformers takes ~5 s on 2 cores (5.4 s of an 18 s `draftflow run` whose stages
    were all reused), so a machine pays it once. The key holds what the answer depends on: the target's content
    fingerprint, `what` (the check and its settings), transformers' and tokenizers' versions, and the code of this
    module and all it imports. A check that fails raises and keeps nothing, and neither does a cache that cannot be
    written; a hub id (fingerprinted by its name, not its content) is checked every time."""
    if not Path(target.path).is_dir():
        return check()
    return kept_answer("preflight", f"{target.fingerprint} {what} {_checking_code()}", check)


def _check_chat(cfg: RunConfig, target: TargetRef) -> None:
    """The target must have a chat template, and `all_turns` needs a prefix-stable one (`_once`)."""
    what = f"chat enable_thinking={cfg.regenerate.enable_thinking} policy={cfg.tokenize.policy}"
    _once(target, what, lambda: _chat_check(cfg, target))


def _chat_check(cfg: RunConfig, target: TargetRef) -> str:
    from draftflow.chat import ChatFormat
    from draftflow.errors import ConversationError

    try:
        chat = ChatFormat.from_pretrained(target.path)
    except DraftflowError as exc:  # name the model: a template error alone does not say whose template
        if target.path in str(exc):
            raise
        raise ConfigError(f"target.path {target.path}: {exc}") from None
    except Exception as exc:  # a corrupt tokenizer.json raises the tokenizers library's own errors
        raise ConfigError(f"cannot load the tokenizer of target.path {target.path} "
                          f"({' '.join(str(exc).split())[:300]}); re-download it") from None
    thinking = cfg.regenerate.enable_thinking
    for value in (False, True) if not isinstance(thinking, bool) else (thinking,):
        try:
            if not chat.encode(PROBE_CONVERSATION, enable_thinking=value):
                raise ConversationError("it supervises no token of the assistant's answer")
        except ConversationError as exc:
            raise ConfigError(f"the chat template of {target.path} fails on a one-turn conversation "
                              f"(enable_thinking={value}): {' '.join(str(exc).split())[:300]}; fix its "
                              "chat_template (chat_template.jinja or tokenizer_config.json)") from None
    if cfg.tokenize.policy == "all_turns" and not chat.is_prefix_stable(enable_thinking=cfg.regenerate.enable_thinking):
        raise ConfigError(
            f"tokenize.policy=all_turns needs a prefix-stable chat template, but {target.path}'s rewrites "
            "earlier turns (e.g. drops their reasoning); use policy auto or per_turn")
    return "ok"


def _check_taps(cfg: RunConfig, target: TargetRef) -> None:
    """The taps every stage will use, resolved and validated against the target once, here first (the target's
    layer count: `_once`)."""
    layers = _once(target, f"layers revision={cfg.target.revision}",
                   lambda: str(target_config(cfg, target).num_hidden_layers))
    feature_ids(cfg.drafter, int(layers))


# ----------------------------------------------------------------------------- space


def free_space(root: str) -> int | None:
    """Free bytes at a local root (its nearest existing parent); None for an object store."""
    if "://" in root and not root.startswith("file://"):
        return None
    p = Path(root.removeprefix("file://")).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def check_space(cfg: RunConfig, tokenize_manifest: Manifest, target: TargetRef,
                free=free_space, fp: str | None = None) -> dict[str, Any]:
    """Refuse to start extract when the destination lacks the space for its features.

    Needed: `feature_bytes` of the train tokens plus those of the largest shard
    (its checkpoint parts and the merged shard coexist until the merge ends).

    Args: `free`: root -> free bytes or None (unknown, e.g. S3); `fp`: extract's fingerprint,
    whose bytes already written (a resumed run) count as done.
    Returns {"needed", "free", "done"} in bytes. Raises DraftflowError unless it fits or `extract.force`.
    """
    tcfg = target_config(cfg, target)
    taps = len(feature_ids(cfg.drafter, tcfg.num_hidden_layers))
    # + the largest shard again: a shard's in-shard checkpoint parts live until it is merged.
    largest = max((s.tokens for s in tokenize_manifest.data_shards("train")), default=0)
    needed = feature_bytes(cfg, (tokenize_manifest.size()["train_tokens"] or 0) + largest, taps, tcfg.hidden_size)
    avail = free(cfg.root) if needed else None
    store, done = Store(cfg.root), 0
    features = maker("features")
    if avail is not None and fp and store.exists(store.stage_path(features, fp)):
        done = int(store.fs.du(store.stage_path(features, fp)))  # a resumed run's shards and parts
    out = {"needed": needed, "free": avail, "done": done}
    if avail is None or needed - done <= avail:
        return out
    msg = (f"extract needs {human_bytes(needed - done)} for features ({taps} taps x {tcfg.hidden_size} x "
           f"{cfg.extract.dtype}) but {cfg.root} has {human_bytes(avail)} free; free space, move root, use "
           "extract.dtype=float8 or extract.mode=online, or set extract.force=true")
    if not cfg.extract.force:
        raise DraftflowError(msg)
    log.warning("%s (extract.force is set: starting anyway)", msg)
    return out


def human_bytes(n: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    k = 0
    while abs(n) >= 1024 and k < len(units) - 1:
        n, k = n / 1024, k + 1
    return f"{n:.0f} B" if k == 0 else f"{n:.1f} {units[k]}"


# ----------------------------------------------------------------------------- sizes and times by stage
# Each stage's size and time model is its `StageSpec.size` / `.seconds` (the models: `draftflow.stages.estimate`).


def _estimate(stage: str, cfg: RunConfig, sizes: dict, ctx: dict) -> dict[str, Any]:
    """A stage's size from its upstream's (measured or estimated) size and the config, by its spec's size
    model; a stage without one is at most its input."""
    s = spec(stage)
    up = sizes.get(s.upstream[0]) if s.upstream else None
    if s.upstream and (up is None or up.get("rows") is None):
        return {"basis": "unknown"}
    if s.size is None:
        return {k: v for k, v in up.items() if k != "basis"} if up else {"basis": "unknown"}
    return s.size(cfg, up, sizes, ctx)


def stage_sizes(cfg: RunConfig, manifests: dict[str, Manifest], ctx: dict) -> dict[str, dict[str, Any]]:
    """Per stage: rows, tokens, bytes and basis ("measured", "estimated" or "unknown")."""
    sizes: dict[str, dict[str, Any]] = {}
    for stage in stage_names():
        if stage in manifests:
            sizes[stage] = manifests[stage].size()
        else:
            sizes[stage] = {"basis": "estimated", "bytes": None} | _estimate(stage, cfg, sizes, ctx)
    return sizes


def stage_seconds(stage: str, cfg: RunConfig, size: dict, shape: dict, prompt_tokens: float) -> float | None:
    """Estimated seconds of one stage on its configured device, by its spec's time model; None when
    unknown (no model, no size, or e.g. HTTP endpoints)."""
    seconds = spec(stage).seconds
    return None if seconds is None or size.get("rows") is None else seconds(cfg, size, shape, prompt_tokens)


# ----------------------------------------------------------------------------- plan


def plan(cfg: RunConfig, target: TargetRef) -> list[dict[str, Any]]:
    """One entry per stage: stage, fingerprint (None while its inputs are unknown), state
    ("complete", "to run", "waits"), rows, tokens, bytes (None when unknown), basis
    ("measured" from its manifest, "estimated", "unknown") and seconds (None when done or unknown)."""
    states, manifests = stage_states(cfg, target.fingerprint)
    shape = model_shape(cfg, target)
    rows, per_row = source_estimate(cfg)
    ctx = {"source_rows": rows, "prompt_tokens": per_row / CHARS_PER_TOKEN, **shape}
    sizes = stage_sizes(cfg, manifests, ctx)
    for s in states:
        size = sizes[s["stage"]]
        done = s["state"] == "complete"
        s.update({k: size.get(k) for k in ("rows", "tokens", "bytes", "basis")})
        s["seconds"] = None if done else stage_seconds(s["stage"], cfg, size, shape, ctx["prompt_tokens"])
    return states


def space_to_finish(cfg: RunConfig, target: TargetRef) -> str:
    """For a run stopped by a full device: what the stages not yet complete need (the plan's estimate) and
    what is free now, as a clause of its one-line error ("" when neither is known)."""
    try:
        todo = [s for s in plan(cfg, target) if s["state"] != "complete"]
        needed = sum(s["bytes"] or 0 for s in todo)
        avail = free_space(cfg.root)
    except Exception:  # noqa: BLE001 - an estimate on a full device must not hide the error it explains
        return ""
    if not needed:
        return ""
    names = ", ".join(s["stage"] for s in todo)
    now = "" if avail is None else f", {human_bytes(avail)} free now"
    return f"; the plan estimates {human_bytes(needed)} for the stages still to run ({names}){now}"


def environment(cfg: RunConfig) -> dict[str, Any]:
    """Where the run writes, the free space there, the devices it plans for, and the model's assumptions."""
    devices = {"target": cfg.target.device, "train": cfg.train.device, "evaluate": cfg.evaluate.device}
    return {"root": cfg.root, "free_bytes": free_space(cfg.root),
            "hardware": {k: hardware(v)[0] for k, v in devices.items()}, "assumptions": assumptions()}
