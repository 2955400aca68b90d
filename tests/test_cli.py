"""Bad input gives one clear line and exit code 2, before anything is written."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from draftflow.export_readme import serve_entry
from draftflow.stages.registry import stage_names
from tests.conftest import n_stages

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def _one_line_error(proc, pattern):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert pattern in lines[0], lines[0]


def test_missing_config_file(tmp_path):
    _one_line_error(_cli("run", str(tmp_path / "none.yaml")), "config file not found")


def test_unknown_config_key(tmp_path):
    proc = _cli("run", "configs/tiny.yaml", "--set", f"root={tmp_path}/r", "--set", "train.learning_rate=1")
    _one_line_error(proc, "unknown config key 'train.learning_rate'")
    assert not (tmp_path / "r").exists()


def test_source_path_that_does_not_exist(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"name: x\nroot: {tmp_path}/r\ncurate:\n  sources:\n    - {{name: s, path: {tmp_path}/no.jsonl}}\n")
    _one_line_error(_cli("run", str(cfg)), f"source 's': path {tmp_path}/no.jsonl does not exist")
    assert not (tmp_path / "r").exists()


def test_layer_id_out_of_range_is_a_config_error(tmp_path):
    proc = _cli("plan", "configs/tiny.yaml", "--set", f"root={tmp_path}/r", "--set", "drafter.target_layer_ids=[1,3,8]",
                "--set", "drafter.num_taps=3")
    _one_line_error(proc, "drafter.target_layer_ids contains 8")


def test_plan_lists_every_stage(tmp_path):
    proc = _cli("plan", "configs/tiny.yaml", "--set", f"root={tmp_path}/r")
    assert proc.returncode == 0, proc.stderr
    states = [line.split()[:2] for line in proc.stdout.splitlines()[1:]]
    assert states[0] == ["curate", "to"] and tuple(s[0] for s in states) == stage_names()


def test_a_source_with_only_bad_rows_stops_at_curate_with_one_clear_line(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"conversations": [{"from": "gpt", "value": "an answer with no question"}]}\n')
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"name: x\nroot: {tmp_path}/r\ncurate:\n  sources:\n    - {{name: s, path: {src}}}\n")
    proc = _cli("run", str(cfg))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("draftflow: error:")]
    assert len(errors) == 1 and "curate kept no training conversations" in errors[0]
    assert "no_user_turn=1" in errors[0]
    assert not list((tmp_path / "r").glob("*/*/manifest.json"))  # nothing looks complete


def test_s3_root_without_credentials_is_one_line(tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull)
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "plan", "configs/tiny.yaml", "--set",
                           "root=s3://draftflow-no-such-bucket/run"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "draftflow: error: storage refused the request" in proc.stderr


def test_s3_that_does_not_know_the_access_key_is_named_as_credentials(tmp_path):
    """A real S3-compatible server (moto, in its own process) that checks keys: S3 answers InvalidAccessKeyId, which
    s3fs turns into a PermissionError; the line must name the credentials, not "make it writable"."""
    import os
    import socket

    pytest.importorskip("moto.server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              env=os.environ | {"INITIAL_NO_AUTH_ACTION_COUNT": "0"},  # moto checks every key
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env |= {"AWS_ACCESS_KEY_ID": "AKIANOSUCHKEY0000000", "AWS_SECRET_ACCESS_KEY": "wrong",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
        deadline = time.monotonic() + 120  # the server's start, not a timing under test
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        proc = subprocess.run([sys.executable, "-m", "flows.cli", "plan", "configs/tiny.yaml", "--set",
                               "root=s3://draftflow-bucket/run"], cwd=ROOT, capture_output=True, text=True,
                              timeout=300, env=env)
    finally:
        server.kill()
        server.wait()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("draftflow: error:")]
    assert len(errors) == 1, proc.stderr
    assert "credentials were refused" in errors[0] and "make it writable" not in errors[0], errors[0]


def test_a_prefect_home_that_cannot_be_written_is_one_line_at_once(tmp_path):
    """PREFECT_HOME under a file: before, the temporary server failed to open its database, uvicorn exited with the
    code Prefect relaunches on, and the run gave up after 120 s and 16 tracebacks. Now: one line, no server."""
    import os

    (tmp_path / "a-file").write_text("")
    env = os.environ | {"PREFECT_HOME": str(tmp_path / "a-file" / "home")}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml", "--set",
                           f"root={tmp_path / 'r'}"], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"draftflow: error: PREFECT_HOME={tmp_path}/a-file/home cannot "
                                                   "be written"), proc.stderr


def test_status_of_a_folder_without_a_run_is_one_line(tmp_path):
    _one_line_error(_cli("status", str(tmp_path)), f"no run found at {tmp_path} (it has no run.json)")


def test_status_of_a_config_before_any_run_lists_every_stage(tmp_path):
    proc = _cli("status", "configs/tiny.yaml", "--set", f"root={tmp_path}/r")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].endswith(f"0/{n_stages()} stages complete")
    assert [line.split()[:2] for line in lines[1:3]] == [["curate", "to"], ["regenerate", "waits"]]
    assert lines[1].split()[-1].startswith(f"{tmp_path}/r/curate/")  # where its output will be
    assert not (tmp_path / "r").exists()  # status writes nothing


def test_deploy_with_an_unknown_name_is_one_line():
    proc = _cli("deploy", "--name", "nightly-typo")
    _one_line_error(proc, "no deployment 'nightly-typo' in deployments/prefect.yaml")


def test_deploy_without_a_server_is_one_line():
    import os

    env = {**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api"}
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "deploy"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    _one_line_error(proc, "no Prefect server answers at http://127.0.0.1:9/api")


def test_every_deployment_binds_to_its_flow_and_pool():
    """prefect.yaml's deployments and those generated per stage, as `draftflow deploy --show` prints them: each
    entry's parameters fit its entry point's signature; every stage of the registry has one, on the `gpu` pool
    exactly when its spec says it uses a GPU (or a stage before it does, with upstream=run)."""
    import importlib
    import inspect

    import yaml

    from draftflow.stages.registry import needed, stage_names
    from draftflow.stages.registry import spec as stage_spec

    STAGES = stage_names()
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "deploy", "--show"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    spec = yaml.safe_load(proc.stdout)
    assert [d["name"] for d in spec["deployments"]][-len(STAGES):] == list(STAGES)  # one per stage, in order
    names = [d["name"] for d in spec["deployments"]]
    assert len(names) == len(set(names)) and set(STAGES) <= set(names)
    for d in spec["deployments"]:
        path, func = d["entrypoint"].split(":")
        flow = getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), func)
        inspect.signature(flow.fn).bind(**d["parameters"])  # raises on a missing or unknown parameter
        stage = d["parameters"].get("stage")
        assert stage is None or stage in STAGES, d["name"]
        upstream = d["parameters"].get("upstream", "reuse")
        runs = (needed(stage) if upstream == "run" else [stage]) if stage else STAGES
        uses_gpu = any(stage_spec(s).gpu for s in runs)
        assert d["work_pool"]["name"] == ("gpu" if uses_gpu else "cpu"), d["name"]
        if d["work_pool"]["name"] == "gpu":
            assert d["work_pool"]["job_variables"]["env"]["DRAFTFLOW_GPU_LIMIT"] == "gpu"
        for schedule in d.get("schedules", []):
            assert len(schedule["cron"].split()) == 5 and schedule["timezone"] == "UTC"
    scheduled = {d["name"]: d["parameters"] for d in spec["deployments"] if d.get("schedules")}
    assert scheduled["nightly"] == {"config_path": "configs/tiny.yaml", "overrides": [], "stage": "regenerate",
                                         "upstream": "run"}
    assert "stage" not in scheduled["weekly"]  # the whole pipeline
    assert scheduled["refresh"]["traffic"] is None  # refresh.traffic of the config, unless the run names one


def test_status_says_why_an_older_result_is_not_reused(tmp_path):
    """After a config edit (or an upgrade) a stage shows as "to run"; its older result is named with
    the fields that differ, so nobody wonders why terabytes are about to be recomputed."""
    from draftflow.runs.runinfo import older_results
    from draftflow.stages.registry import stamp
    from draftflow.store import MANIFEST, Store, code_version
    from tests.conftest import tiny_config

    before = tiny_config(tmp_path / "run", "train.lr=0.001")
    now = tiny_config(tmp_path / "run", "train.lr=0.002")
    store = Store(now.root)
    for fp, version in (("aaaa", code_version("train")), ("bbbb", "0.0.1+old")):
        store.write_json(store.stage_path("train", fp, MANIFEST), {
            "code_version": version, "config": stamp(before, "train", {}).config})
    found = {o["fingerprint"]: o["why"] for o in older_results(store, now, "train", "cccc")}
    assert found == {"aaaa": ["train.lr"], "bbbb": ["code", "train.lr"]}
    assert older_results(store, now, "train", "aaaa")[0]["fingerprint"] == "bbbb"  # its own result is not older


def test_status_names_a_torn_manifest_and_an_unknown_upstream(tmp_path):
    """Every older result shown by `status` has a reason: never "differs in: " and nothing after it."""
    from draftflow.runs.runinfo import older_results
    from draftflow.stages.registry import stamp
    from draftflow.store import MANIFEST, Store, code_version
    from tests.conftest import tiny_config

    cfg = tiny_config(tmp_path / "run")
    store = Store(cfg.root)
    store.write_json(store.stage_path("train", "aaaa", MANIFEST), {
        "code_version": code_version("train"), "config": stamp(cfg, "train", {}).config})
    torn = tmp_path / "run" / "train" / "torn" / MANIFEST
    torn.parent.mkdir(parents=True)
    torn.write_bytes(b'{"code_version": "0.1')
    found = {o["fingerprint"]: o["why"] for o in older_results(store, cfg, "train", None)}
    assert found["torn"] == ["its manifest is unreadable (torn or edited); the stage runs again"]
    assert found["aaaa"] == ["inputs unknown until the stages before it are complete"]
    assert all(found.values())


def test_a_run_folder_from_another_version_is_one_line(tmp_path):
    import json

    import pytest

    from draftflow.errors import DraftflowError
    from draftflow.runs.runinfo import RUN_JSON, recorded_config

    (tmp_path / RUN_JSON).write_text(json.dumps({"draftflow": "0.0.1", "config": {"tokenize": {"old_key": 1}}}))
    with pytest.raises(DraftflowError, match=r"recorded by draftflow 0\.0\.1.*'tokenize\.old_key'.*config file"):
        recorded_config(str(tmp_path))


def test_run_ends_with_the_export_folders_and_their_serve_lines(tmp_path, monkeypatch, capsys):
    """The CLI prints what the pipeline's summary carries (the train stage built the lines)."""
    import draftflow.runs.plan
    import flows.pipeline
    from flows import cli

    serve = {"vllm": "vllm serve org/t --speculative-config '{\"method\": \"dflash\"}'",
             "speculators": "vllm serve org/t --speculative-config '{\"method\": \"dflash\", \"x\": 1}'"}
    summary = {"stages": [], "tau": 2.5, "checkpoint": "/r/train/fp/checkpoint", "report": "/r/evaluate/fp/report.md",
               "exports": {"vllm": "/r/train/fp/export/vllm", "speculators": "/r/train/fp/export/speculators"},
               "serve": serve, "target": "m.Q4_1 (dequantized from Q4_1 (m.Q4_1.gguf), stored float32)"}
    monkeypatch.setattr(draftflow.runs.plan, "preflight", lambda cfg: None)
    monkeypatch.setattr(flows.pipeline, "pipeline", lambda cfg: summary)
    for name in ("_prefect_env", "_user_api", "_cpu_threads"):
        monkeypatch.setattr(cli, name, lambda: None)
    monkeypatch.setattr(cli.console, "quiet_user_errors", lambda: None)
    assert cli.main(["run", str(ROOT / "configs" / "tiny.yaml"), "--set", f"root={tmp_path}/r"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "target: m.Q4_1 (dequantized from Q4_1 (m.Q4_1.gguf), stored float32)" in out  # a GGUF target
    i = out.index("export (vllm): /r/train/fp/export/vllm")
    assert out[i + 1] == f"  serve: {serve['vllm']}"
    assert out[i + 2:i + 4] == ["export (speculators): /r/train/fp/export/speculators",
                                f"  serve: {serve['speculators']}"]


def test_pipeline_summary_resolves_the_manifests_relative_paths_and_makes_the_serve_lines(tiny_cfg):
    """Manifests name outputs relative to their stage folder (a moved root still reads); the summary
    gives where they are in this root, and serve lines made from the export's config for this machine."""
    import json

    from draftflow.contracts import Manifest, StageResult
    from draftflow.store import Store
    from flows.pipeline import summarize

    store = Store(tiny_cfg.root)

    def stage(name, extra):
        path = store.stage_path(name, "fp")
        manifest = Manifest(stage=name, fingerprint="fp", code_version="c", config={}, inputs={}, shards=(),
                            rows_in=1, rows_out=1, dropped={}, tokens=0, extra=extra)
        return StageResult(stage=name, fingerprint="fp", status="ran", digest="d", path=store.url(path),
                           manifest=manifest)

    store.write_json(store.stage_path("train", "fp", "export", "vllm", "config.json"),
                     {"architectures": ["DFlashDraftModel"], "block_size": 8} | serve_entry("dflash", 7))
    train = {"checkpoint": "checkpoint", "export": {"vllm": "export/vllm"}}
    summary = summarize(tiny_cfg, [stage("train", train), stage("evaluate", {"tau": 1.5, "report": "report.md"})],
                        "/models/target")
    where = store.url(store.stage_path("train", "fp"))
    assert summary["checkpoint"] == f"{where}/checkpoint"
    assert summary["exports"] == {"vllm": f"{where}/export/vllm"}
    assert summary["report"] == store.url(store.stage_path("evaluate", "fp", "report.md"))
    assert summary["target"] is None  # not a GGUF target: nothing to say about its weights
    converted = Path(tiny_cfg.root) / "gguf-0123456789abcdef-float32"  # a converted GGUF target's record
    converted.mkdir(parents=True)
    (converted / "draftflow_gguf.json").write_text(json.dumps(
        {"converted_by": "draftflow", "gguf_file": "m.Q4_1.gguf", "quantization": "Q4_1", "dtype": "float32"}))
    gguf = summarize(tiny_cfg, [stage("train", train), stage("evaluate", {"tau": 1.5, "report": "report.md"})],
                     str(converted))
    assert gguf["target"] == "m.Q4_1 (dequantized from Q4_1 (m.Q4_1.gguf), stored float32)"
    line = summary["serve"]["vllm"]
    assert " -m vllm.entrypoints.openai.api_server --model /models/target --dtype auto " in line  # runs as printed
    spec = json.loads(line.split("--speculative-config ", 1)[1].strip("'"))
    assert spec == {"method": "dflash", "model": f"{where}/export/vllm", "num_speculative_tokens": 7}


def test_refresh_with_a_missing_traffic_path_or_none_is_one_line_before_prefect_starts(tmp_path):
    _one_line_error(_cli("refresh", "configs/tiny.yaml", "--set", f"root={tmp_path / 'run'}", "--traffic",
                         str(tmp_path / "no-logs")), "no-logs does not exist; point it at the folder")
    _one_line_error(_cli("refresh", "configs/tiny.yaml", "--set", f"root={tmp_path / 'run'}"),
                    "set refresh.traffic in the config or pass --traffic PATH")
    proc = _cli("history", str(tmp_path / "nowhere"))
    _one_line_error(proc, "no run root at")
