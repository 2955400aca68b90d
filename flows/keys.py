"""Prefect artifact keys, shared by every module that publishes an artifact (no other flows import)."""

from __future__ import annotations

import re


def run_key(cfg) -> str:
    """The artifact key prefix of a run: its name and a short hash of its root, so runs of one config name in
    different roots (a laptop's and the cluster's, two experiments) do not pile up as versions of one key."""
    import hashlib

    return artifact_key(cfg.name, hashlib.sha256(str(cfg.root).encode()).hexdigest()[:6])


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")
