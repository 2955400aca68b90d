"""Shared fixtures: an isolated cache and Prefect home per test session, tiny configs.

Prefect flow tests share one session-scoped test harness (its server takes
20-35 s to start on a 2-core machine); library tests never touch Prefect.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_SESSION_TMP = Path(tempfile.mkdtemp(prefix="draftflow-tests-"))
# Set before anything imports Prefect: each test session gets its own home and cache.
os.environ.setdefault("DRAFTFLOW_CACHE", str(_SESSION_TMP / "cache"))
os.environ["PREFECT_HOME"] = str(_SESSION_TMP / "prefect-home")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

# Tiny models on 2 cores: one intra-op thread each avoids oversubscription (60x slower
# when tasks on a thread pool, or another process, compete for the cores).
import torch  # noqa: E402

torch.set_num_threads(1)

TINY_OVERRIDES = [
    "regenerate.max_new_tokens=24",
    "train.max_steps=24",
    "train.checkpoint_every=8",
    "evaluate.max_new_tokens=16",
    "evaluate.num_prompts=2",
    "drafter.num_layers=1",
]


@pytest.fixture(scope="session")
def tiny_target():
    from draftflow.config import TargetConfig
    from draftflow.target import resolve_target

    return resolve_target(TargetConfig())


def tiny_config(root: Path, *extra: str):
    """configs/tiny.yaml, trimmed for tests: the three small sources (48 conversations)."""
    from draftflow.config import load_config

    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"root={root}", "curate.shard_rows=16", *TINY_OVERRIDES, *extra])
    cfg.curate.sources = [s for s in cfg.curate.sources if s.name != "prompts"]
    return cfg


@pytest.fixture
def tiny_cfg(tmp_path):
    return tiny_config(tmp_path / "run")


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            yield
