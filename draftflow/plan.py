"""What a run would do, without running it: each stage's fingerprint and state.

Walks the stages in order: a stage's fingerprint is known once its inputs'
manifests exist, so `draftflow plan` shows "complete" for reusable stages,
"to run" for the first stage that would run, and "waits" after it.
Also the preflight checks every run passes before any work starts.
"""

from __future__ import annotations

from typing import Any

from draftflow.config import RunConfig
from draftflow.errors import ConfigError
from draftflow.stages.common import fingerprint, manifest_digest
from draftflow.stages.curate import check_sources, source_keys
from draftflow.stages.regenerate import check_engine
from draftflow.store import Store, digest
from draftflow.target import TargetRef, resolve_target

STAGES = ("curate", "regenerate", "tokenize", "extract", "train", "evaluate")
UPSTREAM = {
    "curate": (), "regenerate": ("curate",), "tokenize": ("regenerate",), "extract": ("tokenize",),
    "train": ("extract",), "evaluate": ("curate", "train"),
}


def preflight(cfg: RunConfig) -> TargetRef:
    """Fail fast, before any work, on unreachable sources, a bad target, its chat template, or bad taps."""
    check_sources(cfg.curate)
    target = resolve_target(cfg.target)
    _check_taps(cfg, target)
    _check_chat(cfg, target)
    check_engine(cfg, target)
    return target


def _check_chat(cfg: RunConfig, target: TargetRef) -> None:
    """The target must have a chat template, and `all_turns` needs a prefix-stable one."""
    from draftflow.chat import ChatFormat

    chat = ChatFormat.from_pretrained(target.path)
    if cfg.tokenize.policy == "all_turns" and not chat.is_prefix_stable(enable_thinking=cfg.regenerate.enable_thinking):
        raise ConfigError(
            f"tokenize.policy=all_turns needs a prefix-stable chat template, but {target.path}'s rewrites "
            "earlier turns (e.g. drops their reasoning); use policy auto or per_turn")


def _check_taps(cfg: RunConfig, target: TargetRef) -> None:
    from transformers import AutoConfig

    from draftflow.stages.extract import drafter_layer_ids

    try:
        tcfg = AutoConfig.from_pretrained(target.path, revision=cfg.target.revision)
    except OSError as exc:
        raise ConfigError(f"cannot load the target config from {target.path}: {exc}".splitlines()[0]) from None
    drafter_layer_ids(cfg, tcfg.num_hidden_layers)


def plan(cfg: RunConfig, target: TargetRef) -> list[dict[str, Any]]:
    """One entry per stage: name, fingerprint (or None) and state."""
    store = Store(cfg.root)
    digests: dict[str, str] = {}
    out, blocked = [], False
    for stage in STAGES:
        ups = UPSTREAM[stage]
        if blocked or any(u not in digests for u in ups):
            out.append({"stage": stage, "fingerprint": None, "state": "waits"})
            continue
        inputs = {"target": target.fingerprint, **{u: digests[u] for u in ups}} if ups else {
            "sources": digest(source_keys(cfg.curate))}
        fp = fingerprint(stage, cfg, inputs)
        manifest = store.read_manifest(stage, fp)
        if manifest is None:
            blocked = True
            out.append({"stage": stage, "fingerprint": fp, "state": "to run"})
        else:
            digests[stage] = manifest_digest(manifest)
            out.append({"stage": stage, "fingerprint": fp, "state": "complete",
                        "rows_out": manifest["rows_out"], "tokens": manifest["tokens"]})
    return out
