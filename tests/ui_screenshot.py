"""A documented check of what the Prefect UI shows (not a test: it needs a Chromium, which CI does not have):

    python -m tests.ui_screenshot OUT_DIR [--chromium chromium]

Starts a Prefect server with its UI on a free port, runs two refreshes of the tiny target against it (new
traffic each time), then takes headless-Chromium screenshots of the tau-history artifact (`<run>-refreshes`) and
of the refresh flow run's page into OUT_DIR. Looked at by eye; docs/operations.md "Refreshes" shows the result.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.reliability.procs import PREFECT, ROOT, TINY, free_port, wait_healthy
from tests.traffic_logs import requests, write_log


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--chromium", default="chromium")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="draftflow-ui-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PREFECT_HOME": str(tmp / "home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_API_URL": f"{url}/api"}
    env.pop("PREFECT_API_URL", None)
    server = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                              stdout=open(tmp / "server.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(f"{url}/api", server, tmp / "server.log")
        client_env = {**env, "PREFECT_API_URL": f"{url}/api"}
        sets = [f"root={tmp / 'run'}", f"refresh.traffic={tmp / 'logs'}", "name=ui-check", *TINY,
                "train.max_steps=200", "evaluate.num_prompts=8", "evaluate.ddtree_budgets=[]"]
        for day, n in ((1, 40), (2, 20)):
            write_log(tmp / "logs", f"day{day}.jsonl", requests(n, day))
            subprocess.run([sys.executable, "-m", "flows.cli", "refresh", "configs/tiny.yaml",
                            *[f"--set={s}" for s in sets]], cwd=ROOT, env=client_env, check=True)
        pages = _pages(f"{url}/api")
        for name, path in pages.items():
            subprocess.run([args.chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                            f"--screenshot={out / name}.png", "--window-size=1400,1100",
                            "--virtual-time-budget=20000", f"{url}{path}"], check=True, env=env)
            print(f"{out / name}.png  <- {url}{path}")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    return 0


def _pages(api: str) -> dict[str, str]:
    """UI paths of the refresh-history artifact and of the last refresh flow run."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowFilter, FlowFilterName
        from prefect.client.schemas.sorting import ArtifactSort, FlowRunSort

        # Filtered and sorted by the server: an unfiltered read is its first 200 rows in random id order
        history = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_="-refreshes")),
                                        sort=ArtifactSort.CREATED_DESC, limit=1)
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["draftflow-refresh"])),
                                     sort=FlowRunSort.START_TIME_DESC, limit=1)
        (last_doc,), (last_run,) = history, runs
    return {"ui-refreshes-artifact": f"/artifacts/artifact/{last_doc.id}",
            "ui-refresh-run": f"/runs/flow-run/{last_run.id}"}


if __name__ == "__main__":
    sys.exit(main())
