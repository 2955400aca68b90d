"""Record what a run was (resolved config, package versions, git revision), and say where it stands.

`run.json` is written to the run root at the start of every run (overwritten: it
describes the latest invocation; each stage's manifest keeps its own config).
`recorded_config` reads it back, so a run folder alone names its config;
`stage_status` is `draftflow status`: per stage its state (from `plan.plan`, the same
walk `draftflow plan` makes), counts from its manifest and where its outputs are.
"""

from __future__ import annotations

import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from draftflow import __version__
from draftflow.config import RunConfig, validate_config
from draftflow.errors import DraftflowError
from draftflow.store import MANIFEST, Store, code_version

RUN_JSON = "run.json"
PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "pyarrow", "prefect", "fsspec", "s3fs", "vllm")


def package_versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def git_revision() -> str | None:
    """The project's git revision (with `-dirty` when the tree has changes), if known."""
    here = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=here, capture_output=True, text=True, timeout=5)
        return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def run_info(cfg: RunConfig) -> dict[str, Any]:
    return {
        "config": cfg.model_dump(mode="json"),
        "draftflow": __version__,
        "code_version": code_version(),
        "git_revision": git_revision(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": package_versions(),
    }


def record_run(cfg: RunConfig) -> dict[str, Any]:
    """Write `run.json` into the run root and return it."""
    store = Store(cfg.root)
    info = run_info(cfg)
    store.write_json(store.path(RUN_JSON), info)
    return info


def recorded_config(root: str) -> RunConfig:
    """The config the last run under `root` recorded, with `root` as its root (the folder may have moved).

    Raises DraftflowError (one line saying what to pass instead) when `root` holds no run.
    """
    store = Store(root)
    if not store.exists(store.path(RUN_JSON)):
        raise DraftflowError(f"no run found at {root} (it has no {RUN_JSON}); pass a run folder that "
                             "`draftflow run` wrote (e.g. runs/tiny) or the run's config file (e.g. configs/tiny.yaml)")
    info = store.read_json(store.path(RUN_JSON))
    try:
        return validate_config({**info["config"], "root": root}, f"{root}/{RUN_JSON}")
    except DraftflowError as exc:
        raise DraftflowError(f"the run at {root} was recorded by draftflow {info.get('draftflow', '?')}, whose "
                             f"config this version does not accept ({exc}); pass the run's config file "
                             "instead (draftflow status configs/<name>.yaml)") from None


def stage_status(cfg: RunConfig, target=None) -> list[dict[str, Any]]:
    """Per stage: stage, state ("complete", "running" (with `run`, who: the first stage to run while a run holds
    the root), "to run", "waits"), fingerprint, path (its output folder,
    None while its inputs are unknown); for a complete stage its rows_in, rows_out, dropped (by
    reason), tokens, shards and bytes from its manifest; for the stage to run its `progress` (shards
    done, in-shard checkpoints, train's resume step: `runstate.stage_progress`) and its `older` results.
    Reads manifests and file listings; runs nothing and imports no torch or Prefect."""
    from draftflow.runlock import describe, live_holder
    from draftflow.runs.runstate import stage_progress, stage_states
    from draftflow.target import resolve_target

    store = Store(cfg.root)
    target = target or resolve_target(cfg.target)
    states, manifests = stage_states(cfg, target.fingerprint)
    holder = live_holder(store)  # a run working on the root now: its first stage to run is running
    out = []
    for s in states:
        entry = {k: s[k] for k in ("stage", "state", "fingerprint")}
        if holder and s["state"] == "to run":
            entry |= {"state": "running", "run": describe(holder, time.time())}
            holder = None
        fp = s["fingerprint"]
        entry["path"] = store.url(store.stage_path(s["stage"], fp)) if fp else None
        if s["state"] == "complete":
            m = manifests[s["stage"]]
            entry |= {"rows_in": m.rows_in, "rows_out": m.rows_out, "dropped": m.dropped,
                      "tokens": m.size()["tokens"],  # what `plan` says it measured
                      "shards": len(m.shards), "bytes": sum(x.bytes for x in m.shards), "manifest": m}
        else:
            entry["progress"] = stage_progress(store, cfg, s["stage"], fp, manifests) if fp else None
            entry["older"] = older_results(store, cfg, s["stage"], fp)
        out.append(entry)
    return out


def older_results(store: Store, cfg: RunConfig, stage: str, fp: str | None) -> list[dict[str, Any]]:
    """Complete results of `stage` under other fingerprints, each with why it is not this run's:
    `code` (draftflow or a library it depends on changed), the config fields that differ
    (dotted), `inputs` (an upstream stage's result differs). Newest code version first."""
    from draftflow.stages.registry import spec

    found = []
    for path in store.fs.glob(store.stage_path(stage, "*", MANIFEST)):
        other = path.rstrip("/").split("/")[-2]
        if other == fp:
            continue
        try:
            m = store.read_json(store.stage_path(stage, other, MANIFEST))
        except (OSError, ValueError):
            m = None
        if not isinstance(m, dict):  # torn by a crash or edited: never reused
            found.append({"fingerprint": other, "path": store.url(store.stage_path(stage, other)),
                          "why": ["its manifest is unreadable (torn or edited); the stage runs again"],
                          "code_version": None})
            continue
        why = [] if m.get("code_version") == code_version(stage) else ["code"]
        for name in spec(stage).sections:
            now, then = cfg.section(name), m.get("config", {}).get(name)
            if isinstance(now, dict) and isinstance(then, dict):
                why += [f"{name}.{k}" for k in sorted(set(now) | set(then)) if now.get(k) != then.get(k)]
            elif now != then:
                why.append(name)
        if not why:  # same code and config: the upstream results differ, or are not known yet
            why.append("inputs" if fp is not None else "inputs unknown until the stages before it are complete")
        found.append({"fingerprint": other, "path": store.url(store.stage_path(stage, other)), "why": why,
                      "code_version": m.get("code_version")})
    return sorted(found, key=lambda r: str(r["code_version"]), reverse=True)
