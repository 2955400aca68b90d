"""Against a real Prefect server: the CLI's runs, their artifacts, deployments and a process worker.

One `prefect server start` (SQLite, its own PREFECT_HOME) serves the module. Runs are `draftflow`
subprocesses with PREFECT_API_URL pointing at it (the rest of the session keeps its test harness);
everything is asserted through the Prefect client. State reports reach the server through its event
stream, so reads poll until they settle instead of asserting at once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from draftflow.config import load_config
from draftflow.stages.registry import stage_names
from flows.keys import artifact_key, run_key
from tests.conftest import ROOT, n_stages, tiny_config
from tests.reliability.procs import wait_healthy

STAGES = list(stage_names())  # the registry: the one list of stages
NAME = "server-test"
PREFECT = str(Path(sys.executable).parent / "prefect")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(api url, env for client subprocesses, tmp folder) of a fresh server on a free port."""
    tmp = tmp_path_factory.mktemp("prefect-server")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp / "server-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_UI_ENABLED="false")
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    try:
        wait_healthy(url, proc, tmp / "server.log")
        client_env = {**os.environ, "PREFECT_API_URL": url, "PREFECT_HOME": str(tmp / "client-home"),
                      "DRAFTFLOW_HOME": str(ROOT)}
        yield url, client_env, tmp
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and the uvicorn process it started
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def _client(url: str):
    """A sync Prefect client for the test server (the session's harness settings stay untouched)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    class _Ctx:
        def __enter__(self):
            self.settings = temporary_settings({PREFECT_API_URL: url})
            self.settings.__enter__()
            self.client = get_client(sync_client=True)
            return self.client.__enter__()

        def __exit__(self, *exc):
            self.client.__exit__(*exc)
            self.settings.__exit__(*exc)

    return _Ctx()


def _eventually(check, timeout: float = 60.0, every: float = 1.0):
    """`check()`'s first truthy value, retried while the server catches up with the run's events."""
    end = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > end:
            return value
        time.sleep(every)


def _cli(env: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def config_file(server):
    """The trimmed tiny config as a YAML file subprocesses and workers can load."""
    _, _, tmp = server
    cfg = tiny_config(tmp / "run", f"name={NAME}")
    path = tmp / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return path


@pytest.fixture(scope="module")
def first_run(server, config_file):
    url, env, tmp = server
    proc = _cli(env, "run", str(config_file))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _every(read, **filters) -> list:
    """Every row a Prefect read matches. The server answers at most 200 a call (its default limit), in id order, and
    ids are random: once the module's runs had written more than 200 artifacts, an unpaged read returned a chance
    subset, and a three-refresh run in CI missed its own history."""
    out: list = []
    while batch := read(offset=len(out), limit=200, **filters):
        out.extend(batch)
        if len(batch) < 200:
            break
    return out


def _runs_by_flow(client) -> dict[str, list]:
    flows = {f.id: f.name for f in _every(client.read_flows)}
    out: dict[str, list] = {}
    for run in _every(client.read_flow_runs):
        out.setdefault(flows[run.flow_id], []).append(run)
    return out


def _artifacts(client) -> dict[str, list]:
    out: dict[str, list] = {}
    for a in _every(client.read_artifacts):
        out.setdefault(a.key, []).append(a)
    return out


def test_run_shows_pipeline_stage_flows_artifacts_and_terminal_progress(server, first_run):
    url, _, tmp = server
    assert "mean acceptance length tau" in first_run.stdout
    progress_lines = [line for line in first_run.stderr.splitlines() if line.startswith("progress: ")]
    # The speed appears only once a second has passed (tests/test_progress.py): how fast the tiny
    # regenerate runs depends on the machine's load, so only the count is asserted here.
    assert any(line.startswith("progress: regenerate 43/43 rows (100%)") for line in progress_lines), progress_lines
    assert any(line.startswith("progress: train 24/24 steps") for line in progress_lines), progress_lines
    assert any(line.startswith("progress: evaluate 4/4 phases (100%)") for line in progress_lines), progress_lines

    with _client(url) as client:
        def settled():
            runs = _runs_by_flow(client)
            names = ["draftflow-pipeline", *STAGES]
            ok = all(len(runs.get(n, [])) == 1 and runs[n][0].state.name == "Completed" for n in names)
            return runs if ok else None

        runs = _eventually(settled)
        assert runs, {k: [r.state.name for r in v] for k, v in _runs_by_flow(client).items()}
        pipeline_run = runs["draftflow-pipeline"][0]
        for stage in STAGES:  # stage flows are subflows of the pipeline run
            assert runs[stage][0].parent_task_run_id is not None
            assert client.read_task_run(runs[stage][0].parent_task_run_id).flow_run_id == pipeline_run.id
        tags = {t.name.split("-")[0]: set(t.tags) for s in ("regenerate", "extract", "train", "evaluate")
                for t in _task_runs_of(client, runs[s][0].id)}
        # A CPU-only run: its GPU stages' task runs say so (Ray asks for GPUs by the tag)
        assert tags == {"regenerate": {"cpu"}, "extract": {"cpu"}, "train": {"cpu"}, "evaluate": {"cpu"}}, tags


        logs = _logs_of(client, pipeline_run.id)
        said = [entry.message for entry in logs]  # the pipeline run's own logs: every stage's summary and τ
        for stage in STAGES:
            assert any(m.startswith(f"{stage} ran: ") for m in said), said
        assert any(m.startswith("mean acceptance length tau = ") for m in said), said
        cfg = tiny_config(tmp / "run", f"name={NAME}")  # the run's: the name and a hash of its root (one per root)
        KEY = run_key(cfg)  # noqa: N806
        assert KEY.startswith(f"{NAME}-") and KEY != run_key(cfg.model_copy(update={"root": "elsewhere"}))
        arts = _artifacts(client)
        for stage in STAGES:
            (counts,) = arts[artifact_key(KEY, stage, "counts")]  # a stage name's "_" is "-" in a key
            assert counts.type == "table" and counts.flow_run_id == runs[stage][0].id
        (regen,) = arts[f"{KEY}-regenerate-progress"]
        assert regen.type == "progress" and float(regen.data) == 100.0
        assert regen.description.startswith("regenerate 43/43 rows")  # its speed shows only after a second
        assert float(arts[f"{KEY}-train-progress"][0].data) == 100.0
        (rate,) = arts[f"{KEY}-regenerate-throughput"]
        assert '"rows": 43' in rate.data and '"rows/s"' in rate.data
        (result,) = arts[f"{KEY}-result"]
        assert "τ =" in result.data and "P(at least k drafts accepted)" in result.data  # the evaluate report
        pngs = sorted(p.name for s in ("curate", "train", "evaluate") for p in (tmp / "run" / s).rglob("*.png")
                      if "work" not in p.parts)
        assert len(pngs) >= 4 and "prompt_lengths.png" in pngs  # curate's, train's curves, evaluate's plots
        assert result.data.count("data:image/png;base64,") == len(pngs)  # every plot inlined, none twice
        for what in ("checkpoint", "report"):  # a location as text: the UI opens no file:// link from its page
            (where,) = arts[f"{KEY}-{what}"]
            assert where.type == "markdown" and "file://" not in where.data, where.data
            target = where.data.split("`")[1]
            assert Path(target).exists() and target.startswith(str(tmp / "run")), where.data


def test_status_of_the_run_folder_lists_complete_stages_with_counts_and_paths(server, first_run):
    _, env, tmp = server
    proc = _cli(env, "status", str(tmp / "run"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"run {NAME}") and f"{n_stages()}/{n_stages()} stages complete" in lines[0]
    for stage, line in zip(STAGES, lines[1:]):
        fields = line.split()
        assert fields[:2] == [stage, "complete"], line
        assert Path(fields[-1]).parent == tmp / "run" / stage and (Path(fields[-1]) / "manifest.json").is_file()
    assert "dropped duplicate=1, malformed_json=1, no_user_turn=1" in lines[1]


def test_rerun_after_losing_a_manifest_takes_shards_from_the_cache(server, first_run, config_file):
    url, env, tmp = server
    for manifest in (tmp / "run" / "regenerate").glob("*/manifest.json"):
        manifest.unlink()
    proc = _cli(env, "run", str(config_file))
    assert proc.returncode == 0, proc.stderr[-4000:]
    statuses = [line.split()[1] for line in proc.stdout.splitlines()[:6]]
    assert statuses == ["reused", "ran", "reused", "reused", "reused", "reused"], proc.stdout

    with _client(url) as client:
        def cached_shards():
            runs = sorted(_runs_by_flow(client).get("regenerate", []), key=lambda r: r.created)
            if len(runs) < 2 or runs[-1].state.name != "Completed":
                return None
            tasks = [t for t in _task_runs_of(client, runs[-1].id) if t.name.startswith("regenerate-shard")]
            return tasks if len(tasks) == 3 and all(t.state.name == "Cached" for t in tasks) else None

        tasks = _eventually(cached_shards)
        assert tasks, "the second run's regenerate shards did not come back Cached"


def _logs_of(client, flow_run_id) -> list:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    return _every(client.read_logs, log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))


def _task_runs_of(client, flow_run_id) -> list:
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId

    return _every(client.read_task_runs,
                  task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run_id])))


def _run_deployments(url: str, env: dict, pool: str, runs: list[tuple[str, dict, dict]]) -> list:
    """Create runs of the given (deployment, parameters, options) and let one process worker of `pool`
    take them all (concurrently); their final flow runs."""
    with _client(url) as client:
        ids = [client.create_flow_run_from_deployment(client.read_deployment_by_name(name).id, parameters=params,
                                                      **options).id for name, params, options in runs]
    worker = subprocess.run([PREFECT, "worker", "start", "--pool", pool, "--type", "process", "--run-once"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert worker.returncode == 0, worker.stdout[-3000:] + worker.stderr[-3000:]
    with _client(url) as client:
        final = _eventually(lambda: all(client.read_flow_run(i).state.is_final() for i in ids))
        assert final, [client.read_flow_run(i).state.name for i in ids]
        return [client.read_flow_run(i) for i in ids]


def test_deployments_from_the_yaml_run_on_process_workers_under_the_gpu_limit(server, config_file):
    url, env, tmp = server
    # One `prefect deploy` costs ~12 s here (it imports the flows): deploy a selection that covers each
    # kind (CPU stage, GPU stage, scheduled); test_cli checks every entry of the yaml against its flow.
    chosen = ["draftflow-stage/curate", "tokenize", "regenerate", "nightly", "weekly"]
    proc = _cli(env, "deploy", *[a for n in chosen for a in ("--name", n)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "created work pool cpu" in proc.stdout and "created global concurrency limit gpu" in proc.stdout
    with _client(url) as client:
        deployments = {d.name: d for d in client.read_deployments()}
        assert set(deployments) == {"curate", "tokenize", "regenerate", "nightly", "weekly"}  # only those named
        assert {n: d.work_pool_name for n, d in deployments.items()} == {
            "curate": "cpu", "tokenize": "cpu", "regenerate": "gpu", "nightly": "gpu", "weekly": "gpu"}
        assert [s.schedule.cron for s in deployments["nightly"].schedules] == ["0 2 * * *"]
        assert [s.schedule.cron for s in deployments["weekly"].schedules] == ["0 3 * * 0"]
        assert deployments["nightly"].parameters["upstream"] == "run"
        assert deployments["regenerate"].job_variables["env"]["DRAFTFLOW_GPU_LIMIT"] == "gpu"
        assert {p.name for p in client.read_work_pools()} >= {"cpu", "gpu"}
        assert client.read_global_concurrency_limit_by_name("gpu").limit == 1

    root = tmp / "deployed"
    params = {"config_path": str(config_file), "overrides": [f"root={root}"]}
    empty = {**params, "overrides": [f"root={tmp / 'empty'}"]}
    curate, tok = _run_deployments(url, env, "cpu", [("draftflow-stage/curate", params, {}),
                                                             ("draftflow-stage/tokenize", empty, {})])
    assert curate.state.name == "Completed", curate.state.message
    assert list(root.glob("curate/*/manifest.json"))
    # A stage whose upstream is not complete fails with one line naming what to run first.
    assert tok.state.name == "Failed" and "needs curate complete" in tok.state.message
    # A GPU stage holds a slot of the strict `gpu` limit: it runs with the limit, fails without one.
    no_limit = {"job_variables": {"env": {"DRAFTFLOW_GPU_LIMIT": "no-such-limit"}}}
    # Another seed: its own regenerate stage, which must run (a reused stage takes no slot), whichever
    # of the two concurrent runs finishes first. They share the root, so the second waits for the run lock.
    waiting = [*params["overrides"], "lock.wait_s=600"]
    other = {**params, "overrides": [*waiting, "regenerate.seed=1"]}
    first = {**params, "overrides": waiting}
    regen, missing = _run_deployments(url, env, "gpu", [("draftflow-stage/regenerate", first, {}),
                                                        ("draftflow-stage/regenerate", other, no_limit)])
    assert regen.state.name == "Completed", regen.state.message
    assert list(root.glob("regenerate/*/manifest.json"))
    assert missing.state.name == "Failed" and "no-such-limit" in missing.state.message
    with _client(url) as client:  # the slot is taken in the regenerate subflow of that run
        subflow = _eventually(lambda: [r for r in _every(client.read_flow_runs) if r.parent_task_run_id is not None and
                                       client.read_task_run(r.parent_task_run_id).flow_run_id == regen.id])
        assert subflow
        logs = _eventually(lambda: [g.message for g in _logs_of(client, subflow[0].id)
                                    if "slot(s) of the GPU" in g.message])
        assert logs == ["holding 1 slot(s) of the GPU concurrency limit 'gpu'"]


def test_draftflow_server_ui_reaches_its_api_on_any_port_and_sigterm_stops_the_child(tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_UI_API_URL")}
    env.update(PREFECT_HOME=str(tmp_path / "home"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "server", "--port", str(port)], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    try:
        wait_healthy(url, proc, tmp_path / "server.log")
        settings = httpx.get(f"http://127.0.0.1:{port}/ui-settings", timeout=10).json()
        assert settings["api_url"] == url  # the browser UI calls this API: the one that answers
        assert httpx.get(f"{settings['api_url']}/health", timeout=10).status_code == 200
        proc.send_signal(signal.SIGTERM)  # to draftflow server only, not its process group
        assert proc.wait(timeout=120) is not None
        with pytest.raises(httpx.HTTPError):  # the prefect server child went with it
            for _ in range(200):  # bounded: the child may take a moment to close its socket
                httpx.get(f"{url}/health", timeout=2)
                time.sleep(0.1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def test_three_refreshes_through_the_refresh_deployment_on_a_process_worker(server):
    """`draftflow deploy --name refresh`, then three runs of it on a real process worker, traffic written between
    them: the first trains and promotes; the second warm-starts on new traffic and promotes; the third, on traffic
    built to hurt (800 requests in another script, none of the served categories), trains and is refused by the
    per-category gate, so the promoted drafter stays. `draftflow history` prints the three lines and the UI has the
    tau-history artifact."""
    from tests.traffic_logs import requests, write_log

    url, env, tmp = server
    proc = _cli(env, "deploy", "--name", "refresh")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    root, logs = tmp / "refreshed", tmp / "logs"
    config = tmp / "refresh.yaml"  # the embedded default, evaluated on enough prompts per category to judge them
    config.write_text(yaml.safe_dump({
        "base": str(ROOT / "configs" / "tiny.yaml"), "name": "refresh-test", "root": str(root),
        "train": {"max_steps": 400}, "evaluate": {"num_prompts": 16, "ddtree_budgets": []},
        "refresh": {"traffic": str(logs), "holdout": 0.2, "max_regression": 0.05, "max_category_regression": 0.03}}))
    worker_env = {**env, "DRAFTFLOW_TORCH_THREADS": "1"}  # one thread: the same floats, busy machine or not
    params = {"config_path": str(config), "overrides": []}
    batches = [("day1.jsonl", requests(60, 1), True), ("day2.jsonl", requests(40, 2), False),
               ("day3.jsonl", requests(800, 3, other_language=True), False)]
    for name, rows, bad in batches:
        write_log(logs, name, rows, bad=bad)
        (run,) = _run_deployments(url, worker_env, "gpu", [("draftflow-refresh-from-file/refresh", params, {})])
        assert run.state.name == "Completed", run.state.message
    proc = _cli(env, "history", str(root))
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == 3, proc.stdout + proc.stderr
    pattern = r"refresh {}: \d{{4}}-\d\d-\d\d new_rows {} tau \d\.\d{{3}} live_tau {} promoted {} .+"
    assert re.fullmatch(pattern.format(1, 60, "-", "yes"), lines[0]), lines[0]
    assert re.fullmatch(pattern.format(2, 40, r"\d\.\d{3}", "yes"), lines[1]), lines[1]
    assert re.fullmatch(pattern.format(3, 800, r"\d\.\d{3}", "no"), lines[2]), lines[2]
    assert "max_category_regression" in lines[2]
    entries = json.loads((root / "refresh/history.json").read_text())["refreshes"]
    trains = [e["train"] for e in entries]
    pointer = json.loads((root / "promoted.json").read_text())
    assert pointer["current"]["train"] == trains[1] and [h["train"] for h in pointer["history"]] == trains[:2]
    assert (root / f"train/{trains[1]}/export/promoted.json").exists()
    assert not (root / f"train/{trains[2]}/export/promoted.json").exists()
    warm = json.loads((root / f"train/{trains[2]}/manifest.json").read_text())["extra"]["init_from"]
    assert warm["train_fingerprint"] == trains[1]  # the third started from the second, the live drafter
    # A fourth run with no new log file does nothing, and says so.
    (run,) = _run_deployments(url, worker_env, "gpu", [("draftflow-refresh-from-file/refresh", params, {})])
    assert run.state.name == "Completed"
    with _client(url) as client:
        assert _eventually(lambda: any("no new traffic under" in g.message for g in _logs_of(client, run.id)))
        key = f"{run_key(load_config(str(config)))}-refreshes"
        docs = _eventually(lambda: len(found := _artifacts(client).get(key, [])) >= 3 and found)
        assert docs, f"fewer than 3 versions of the artifact {key}"
        latest = max(docs, key=lambda a: a.created).data
        assert "candidate" in latest and "| 3 |" in latest and "| 4 |" not in latest


def test_a_run_stopped_with_sigterm_shows_cancelled_with_its_line_in_the_logs(server, tmp_path):
    """Interrupted runs used to show as Crashed, with none of their one line in the run's logs."""
    from tests.reliability.procs import finish, start_and_wait_for_training

    url, env, _ = server
    root, log = tmp_path / "run", tmp_path / "run.log"
    proc, _ = start_and_wait_for_training(env, root, log)
    os.kill(proc.pid, signal.SIGTERM)
    rc, _ = finish(proc, 60)
    line = log.read_text().strip().splitlines()[-1]
    assert rc == 128 + signal.SIGTERM and line.startswith("draftflow: interrupted (SIGTERM) at train step"), line
    with _client(url) as client:
        runs = _eventually(lambda: [r for r in _runs_by_flow(client).get("draftflow-pipeline", [])
                                    if r.parameters.get("cfg", {}).get("root") == str(root)])
        assert len(runs) == 1
        state = _eventually(lambda: client.read_flow_run(runs[0].id).state)
        assert state.name == "Cancelled" and state.message == line
        assert _eventually(lambda: [g for g in _logs_of(client, runs[0].id) if g.message == line])
        train = _eventually(lambda: [r for r in _runs_by_flow(client).get("train", [])
                                     if r.parent_task_run_id and client.read_task_run(r.parent_task_run_id)
                                     .flow_run_id == runs[0].id])
        assert train and client.read_flow_run(train[0].id).state.name == "Cancelled"


def test_cancelling_a_deployment_run_from_prefect_stops_it_on_its_worker_and_shows_cancelled(server, config_file):
    """Prefect cancels a running deployment run by SIGTERM in its process (the worker's): the run stops at its next
    training step with a checkpoint, shows as Cancelled (not Crashed) with its one line, its stage subflows too,
    and nothing it started is left running."""
    from prefect.states import Cancelling

    from tests.reliability.procs import alive, descendants

    url, env, tmp = server
    proc = _cli(env, "deploy", "--name", "manual")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    root = tmp / "cancelled"
    params = {"config_path": str(config_file),
              "overrides": [f"root={root}", "train.max_steps=2000", "train.checkpoint_every=8"]}
    with _client(url) as client:
        run_id = client.create_flow_run_from_deployment(
            client.read_deployment_by_name("draftflow-pipeline-from-file/manual").id, parameters=params).id
    with open(tmp / "cancel-worker.log", "w") as log:
        worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "gpu", "--type", "process"], cwd=ROOT,
                                  env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            assert _eventually(lambda: len(list(root.glob("train/*/work/checkpoints/step_*"))) >= 2, timeout=600,
                               every=0.5), (tmp / "cancel-worker.log").read_text()[-3000:]
            started = descendants(worker.pid) - {worker.pid}
            with _client(url) as client:
                client.set_flow_run_state(run_id, Cancelling(message="cancelled by the test"), force=True)
                state = _eventually(lambda: (s := client.read_flow_run(run_id).state).is_final()
                                    and s.name == "Cancelled" and s, timeout=120, every=0.5)
                assert state and state.message.startswith("draftflow: interrupted (SIGTERM) at train step"), \
                    client.read_flow_run(run_id).state
                logs = _eventually(lambda: [g for g in _logs_of(client, run_id) if g.message == state.message])
                assert logs
                nested = [r for r in _every(client.read_flow_runs) if r.name != client.read_flow_run(run_id).name
                          and r.state.name not in ("Completed", "Cancelled")
                          and str(r.parameters.get("cfg", {}).get("root", "")) == str(root)]
                assert not nested, [(r.name, r.state.name) for r in nested]
            assert _eventually(lambda: not alive(started), timeout=60), alive(started)
            assert any(root.glob("train/*/work/checkpoints/step_*"))  # the step it stopped at is kept
        finally:  # the worker's own shutdown is not under test: Prefect 3.9's process worker, idle, did not exit
            # within 90 s of SIGTERM or SIGINT here (2026-12-07), and this wait for it was ~180 s of the test's ~230
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=60)
