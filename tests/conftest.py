"""Shared fixtures: an isolated cache and Prefect home per test session, tiny configs.

Prefect flow tests share one session-scoped test harness (its server takes
20-35 s to start on a 2-core machine); library tests never touch Prefect.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from fnmatch import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_SESSION_TMP = Path(tempfile.mkdtemp(prefix="draftflow-tests-"))
# a process that only imports this module (a spawned worker) and never writes there leaves nothing in /tmp
atexit.register(lambda: _SESSION_TMP.rmdir() if _SESSION_TMP.is_dir() and not any(_SESSION_TMP.iterdir()) else None)
# Set before anything imports Prefect: each test session gets its own home and cache.
os.environ.setdefault("DRAFTFLOW_CACHE", str(_SESSION_TMP / "cache"))
os.environ["PREFECT_HOME"] = str(_SESSION_TMP / "prefect-home")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")


def pytest_unconfigure(config):
    """The session's cache and Prefect home go with it: a session that converted a GGUF left ~0.5 GB in /tmp, and a
    day of test runs filled this machine's disk."""
    shutil.rmtree(_SESSION_TMP, ignore_errors=True)


# Tiny models on 2 cores: one intra-op thread each avoids oversubscription (60x slower
# when tasks on a thread pool, or another process, compete for the cores).
import torch  # noqa: E402

torch.set_num_threads(1)

# The slow tier, marked here rather than in each module (`make test-fast` = -m "not vllm and not slow",
# under 2 min on 2 cores; `make test` runs everything). Slow: whole pipelines and Prefect flows, the Prefect
# server and the session harness (20-35 s to start), spawned processes (torchrun, gloo ranks, Ray, worker
# pools, SIGKILLed runs, CLI runs that import the flows), anything over ~2 s. fnmatch patterns on node ids.
SLOW = [
    "tests/test_pipeline.py::*",  # the whole pipeline, kill and resume (harness)
    "tests/test_eagle3_pipeline.py::*",  # the EAGLE-3 pipeline (harness)
    "tests/test_s3_run.py::*",  # the whole pipeline on a moto S3 bucket (harness)
    "tests/test_curate_flow.py::*",  # the curate flow (harness)
    "tests/test_server.py::*",  # its own `prefect server start`, CLI runs, process workers (~2 min)
    "tests/test_benchmarks.py::*",  # each benchmark in a subprocess (1-5 s each)
    "tests/test_regenerate_resume.py::*",  # SIGKILL mid-shard then rerun, subprocesses
    "tests/test_extract_resume.py::test_sigkill_mid_shard_then_rerun_equals_an_uninterrupted_run",
    "tests/test_ray.py::test_gpu_tasks_ask_ray_for_gpus_and_workers_import_the_repo_with_one_torch_thread",
    "tests/test_ray.py::test_thread_runner_stays_in_the_flow_process",  # harness
    "tests/test_ray.py::test_pipeline_on_ray_writes_the_same_manifests_as_on_threads",
    "tests/test_ray_cluster.py::*",  # `ray start` head + worker node, stage flows under the harness (1-3 min)
    "tests/test_multinode.py::*",  # two torchrun nodes on moto S3, three launches and a SIGKILL (~2 min)
    "tests/test_launch.py::test_torchrun_stage_equals_in_process_training",
    "tests/test_launch.py::test_a_rank_crash_is_one_line_with_the_exit_code_and_log_and_no_manifest",
    "tests/test_launch.py::test_a_user_error_in_a_rank_is_a_draftflow_error",
    "tests/test_launch.py::test_timeout_kills_the_ranks",
    "tests/test_distributed.py::test_two_gloo_ranks_equal_one_process",
    "tests/test_distributed.py::test_fsdp_equals_one_process_and_checkpoints_resume_across_modes",  # ~9 s
    "tests/test_tokenize_stage.py::test_worker_processes_give_the_same_rows_as_one_process",  # ~8 s
    "tests/test_layering.py::test_importing_every_library_module_leaves_prefect_unloaded",  # fresh interpreter, ~5 s
    "tests/test_tempserver.py::test_a_flow_runs_on_it_and_its_run_outlives_it_in_prefect_home",  # two servers
    "tests/test_runlock.py::test_draftflow_run_on_a_busy_root_exits_2_in_one_line_before_any_work",  # CLI run, ~4 s
    "tests/test_cli.py::test_a_source_with_only_bad_rows_stops_at_curate_with_one_clear_line",  # a real run, ~18 s
    "tests/test_cli.py::test_s3_root_without_credentials_is_one_line",  # CLI subprocesses, 3.5-4 s each
    "tests/test_cli.py::test_status_of_a_config_before_any_run_lists_every_stage",
    "tests/test_cli.py::test_plan_lists_every_stage",
    "tests/test_cli.py::test_layer_id_out_of_range_is_a_config_error",
    # KV-cached decoding with trained drafters (~4 s to train both kinds; the untrained cases stay fast)
    "tests/test_evaluate_cached.py::test_cached_equals_uncached_tokens_and_steps[[]*-trained]",
    "tests/test_evaluate_cached.py::test_eos_and_max_new_tokens_inside_a_block*",
    "tests/test_evaluate_cached.py::test_evaluate_prompts_same_report_with_and_without_cache",
]
# Whatever needs these fixtures is slow too, listed or not: the fast tier never starts Prefect's harness or Ray.
SLOW_FIXTURES = {"prefect_harness", "ray_instance"}
# Slow tests of the machinery around the stages (Prefect's server, deployments and workers, Ray clusters,
# torchrun launches and nodes, gloo ranks, the benchmarks' scripts, the temporary server, the root's lease, a fresh
# interpreter's imports), marked `machinery`: .ci/run runs them, and the slow tests of the stages and their wiring,
# once each, in the worked examples' copy (its code is this tree's plus the examples; the two sets run in different
# lanes). `make test-slow` runs all of them here, `make test-slow-stages` all but these.
MACHINERY = [
    "tests/test_server.py::*",
    "tests/test_ray_cluster.py::*",
    "tests/test_multinode.py::*",
    "tests/test_launch.py::*",
    "tests/test_distributed.py::*",
    "tests/test_benchmarks.py::*",
    "tests/test_tempserver.py::*",
    "tests/test_heartbeats.py::test_subflows_*",
    "tests/test_flow_schemas.py::test_a_marked_flow_run_*",
    "tests/test_runlock.py::*",
    "tests/test_layering.py::*",
]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) or any(fnmatch(item.nodeid, p) for p in SLOW):
            item.add_marker(pytest.mark.slow)
            if any(fnmatch(item.nodeid, p) for p in MACHINERY):
                item.add_marker(pytest.mark.machinery)

TINY_OVERRIDES = [
    "regenerate.max_new_tokens=24",
    "train.max_steps=24",
    "train.checkpoint_every=8",
    "evaluate.max_new_tokens=16",
    "evaluate.num_prompts=2",
    "drafter.num_layers=1",
]


# Conversations an engine must answer like transformers does: a single turn, a system prompt, multi-turn
# with thinking on, and a tool call with its result (the HTTP engine's and the vLLM engine's tests).
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": CITY}}]
CONVERSATIONS = [
    ([{"role": "user", "content": "Hello there"}], {"enable_thinking": False}),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}], {}),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
      {"role": "user", "content": "How are you?"}], {"enable_thinking": True}),
    ([{"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": "", "tool_calls": [
          {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
      {"role": "tool", "content": "sunny"}], {"tools": TOOLS, "enable_thinking": False}),
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
    from draftflow.drafters.dflash.config import DFlashConfig

    return DFlashConfig.from_target(target.config, DrafterConfig(num_layers=1, block_size=B, num_taps=3), MASK_ID)


def n_stages() -> int:
    """How many stages the registry has (a worked example's copy has more than six)."""
    from draftflow.stages.registry import stage_names

    return len(stage_names())


def stage_of(summary: dict, name: str) -> dict:
    """A pipeline summary's entry for stage `name`, by name: a worked example's copy puts stages between the six."""
    return next(s for s in summary["stages"] if s["stage"] == name)


def run_front(cfg, tiny_target):
    """curate -> regenerate -> tokenize of the first train shard, through the library.

    Returns:
        (store, curate shard, regenerate fingerprint, regenerate result, tokenize result)
    """
    from draftflow.stages import curate, regenerate, tokenize
    from draftflow.stages.common import Source, manifest_digest
    from draftflow.stages.registry import stamp
    from draftflow.store import Store

    store = Store(cfg.root)
    cm = curate.run(store, stamp(cfg, "curate", {}), cfg)
    rfp = stamp(cfg, "regenerate", {"curate": manifest_digest(cm)}).fingerprint
    shard = [s for s in cm.shards if s.split == "train"][0]
    rres = regenerate.run_shard(store, rfp, cfg, tiny_target, Source("curate", cm.fingerprint), shard)
    tres = tokenize.run_shard(store, "tokfp", cfg, tiny_target, Source("regenerate", rfp), rres.shard)
    return store, shard, rfp, rres, tres


def one_shard_features(cfg, tiny_target):
    """`run_front`, then extract of its train shard with a complete extract manifest ("exfp"):
    (store, the features training reads)."""
    from draftflow.contracts import StoredFeatures
    from draftflow.stages import extract
    from draftflow.stages.common import Source, finalize

    store, _, _, _, tres = run_front(cfg, tiny_target)
    eres = extract.run_shard(store, "exfp", cfg, tiny_target, Source("tokenize", "tokfp"), tres.shard)
    manifest = finalize(store, stamped("extract", "exfp", {}), [eres])
    return store, StoredFeatures(stage="extract", fingerprint="exfp", shards=manifest.data_shards("train"))


@pytest.fixture(scope="module")
def target():
    """A tiny random Qwen3 target built in code (6 layers, hidden 64, vocab 320)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg).eval()


def restore_environ(old: dict[str, str | None]) -> None:
    """Put back environment variables saved as {name: value or None (was unset)}."""
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


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
        restore_environ(old)
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


@pytest.fixture(scope="module")
def s3_env():
    """A real S3-compatible server (moto) on 127.0.0.1; yields its endpoint with the env set for s3fs."""
    with moto_s3() as endpoint:
        yield endpoint


def preempt_training(monkeypatch, at: int) -> Callable[[], None]:
    """Make `train_drafter` die ("preempted") in its `at`-th optimizer step call; returns the undo."""
    import draftflow.training.loop as train_mod

    real_step, calls = train_mod._train_step, []

    def preempted(*args, **kw):
        calls.append(1)
        if len(calls) == at:
            raise RuntimeError("preempted")
        return real_step(*args, **kw)

    monkeypatch.setattr(train_mod, "_train_step", preempted)
    return lambda: monkeypatch.setattr(train_mod, "_train_step", real_step)


def patch_stage(monkeypatch, stage: str, **changes) -> None:
    """Give `stage`'s registry spec other fields (e.g. a wrapped `run_shard`) until the test ends: the registry in use
    becomes one with that spec (the registry is a value: `REGISTRY` itself is not changed). The context variable is
    swapped for one whose default is it, so Prefect's task threads, which copy the context, see it too."""
    import dataclasses
    from contextvars import ContextVar

    from draftflow.stages import registry

    patched = registry.Registry(tuple(dataclasses.replace(s, **changes) if s.name == stage else s
                                      for s in registry.current().stages))
    monkeypatch.setattr(registry, "_IN_USE", ContextVar("draftflow_registry", default=patched))


def greedy_samples(target, dcfg, prompts: list[list[int]], new_tokens: int = 19) -> list:
    """Training samples from the target's own greedy continuations of `prompts`: the continuation
    supervised, features at the drafter's taps (what extract would store, unrounded)."""
    from draftflow.evaluation.decode import capture_taps, greedy_generate
    from draftflow.features import FeatureSample

    samples = []
    for i, p in enumerate(prompts):
        ids = p + greedy_generate(target, p, new_tokens, set())
        _, feats = capture_taps(target, ids, dcfg.target_layer_ids)
        mask = torch.tensor([0] * len(p) + [1] * new_tokens, dtype=torch.bool)
        taps = len(dcfg.target_layer_ids)
        samples.append(FeatureSample(f"s{i}", torch.tensor(ids), mask, feats.reshape(len(ids), taps, -1)))
    return samples


def stamped(stage: str, fp: str, inputs: dict[str, str]):
    """A stage's stamp with a fixed fingerprint and no config sections, for tests that run one stage's function
    into a folder of their choosing (a run gets its stamp from the registry: `registry.stamp`)."""
    from draftflow.contracts import Stamp

    return Stamp(stage=stage, fingerprint=fp, inputs=inputs, config={})
