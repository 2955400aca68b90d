"""Shared fixtures: an isolated cache and Prefect home per test session, tiny configs.

Prefect flow tests share one session-scoped test harness (its server takes
20-35 s to start on a 2-core machine); library tests never touch Prefect.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
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


# The code-built tiny target below has 320 embedding rows: id 300 is an (untrained) row the
# drafter tests use as the DFlash mask token; B is their block size.
MASK_ID = 300
B = 4


@pytest.fixture(scope="module")
def dcfg(target):
    """A 1-layer, block-4, 3-tap drafter config for the code-built tiny target."""
    from draftflow.config import DrafterConfig
    from draftflow.models.dflash import DFlashConfig

    return DFlashConfig.from_target(target.config, DrafterConfig(num_layers=1, block_size=B, num_taps=3), MASK_ID)


def run_front(cfg, tiny_target):
    """curate -> regenerate -> tokenize of the first train shard, through the library.

    Returns:
        (store, curate shard, regenerate fingerprint, regenerate result, tokenize result)
    """
    from draftflow.stages import curate, regenerate, tokenize
    from draftflow.stages.common import fingerprint, manifest_digest
    from draftflow.store import Store

    store = Store(cfg.root)
    cm = curate.run(store, fingerprint("curate", cfg, {}), cfg, {})
    rfp = fingerprint("regenerate", cfg, {"curate": manifest_digest(cm)})
    shard = [s for s in cm["shards"] if s["split"] == "train"][0]
    rres = regenerate.run_shard(store, rfp, cfg, tiny_target, cm["fingerprint"], shard)
    tres = tokenize.run_shard(store, "tokfp", cfg, tiny_target, rfp, rres["shard"])
    return store, shard, rfp, rres, tres


@pytest.fixture(scope="module")
def target():
    """A tiny random Qwen3 target built in code (6 layers, hidden 64, vocab 320)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg).eval()


@contextmanager
def moto_s3(**extra_env: str):
    """A real S3-compatible server (moto) on 127.0.0.1 with the env set for s3fs (fake credentials,
    overridable through `extra_env`); yields its endpoint; the env is restored afterwards."""
    moto_server = pytest.importorskip("moto.server")
    import s3fs

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://{host}:{port}", **extra_env}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield env["AWS_ENDPOINT_URL"]
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


@pytest.fixture(scope="module")
def s3_env():
    """A real S3-compatible server (moto) on 127.0.0.1; yields its endpoint with the env set for s3fs."""
    with moto_s3() as endpoint:
        yield endpoint


def preempt_training(monkeypatch, at: int) -> Callable[[], None]:
    """Make `train_drafter` die ("preempted") in its `at`-th optimizer step call; returns the undo."""
    import draftflow.train as train_mod

    real_step, calls = train_mod._train_step, []

    def preempted(*args, **kw):
        calls.append(1)
        if len(calls) == at:
            raise RuntimeError("preempted")
        return real_step(*args, **kw)

    monkeypatch.setattr(train_mod, "_train_step", preempted)
    return lambda: monkeypatch.setattr(train_mod, "_train_step", real_step)
