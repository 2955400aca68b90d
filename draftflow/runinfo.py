"""Record what a run was: resolved config, package versions, git revision.

Written to `<root>/run.json` at the start of every run (overwritten: it
describes the latest invocation; each stage's manifest keeps its own config).
"""

from __future__ import annotations

import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from draftflow import __version__
from draftflow.config import RunConfig
from draftflow.store import Store, code_version

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
    store.write_json(store.path("run.json"), info)
    return info
