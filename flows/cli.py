"""`draftflow run|refresh|history|plan|status|server|deploy|compare`: a config path plus dotted overrides, nothing more.

Lives in the flows layer because `run` starts the Prefect pipeline flow. Bad
input (missing config, unknown key, unreachable source, bad taps) is reported
as one line before Prefect starts; nothing is written. `run` draws progress
bars on a terminal (plain progress lines every few seconds otherwise, on stderr).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from draftflow.errors import DraftflowError
from flows import console
from flows.signals import RunInterrupted, end_interrupted, interruptible
from flows.status import _duration, _num, _size, cmd_history, cmd_status, print_summary


def _prefect_env():
    """`run`'s Prefect: the settings below, and Prefect's temporary server launched now when no
    PREFECT_API_URL is set (`flows.tempserver`: it starts while the stages import). Returns it or None."""
    _prefect_settings()
    from flows import tempserver

    return tempserver.start()


def _user_api() -> str | None:
    """The user's PREFECT_API_URL, once it answers (one line if it does not), or None when unset."""
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    if url:
        from flows.apiwatch import check_reachable

        check_reachable(url)
    return url


def _prefect_settings() -> None:
    # A fresh PREFECT_HOME needs longer than the default 20 s to start the ephemeral server.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "draftflow")
    # No telemetry from an offline machine (its failures only add error lines to the log).
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # A PREFECT_HOME that cannot be made is one line of ours (`tempserver.check_home`), not Prefect's warnings too.
    import warnings

    warnings.filterwarnings("ignore", message="Failed to create the Prefect home directory")


def _cpu_threads() -> None:
    """On CPU, one torch thread per task: shard tasks run two at a time on a thread pool,
    and letting each use every core oversubscribes them (measured 60x slower per forward)."""
    import torch

    if not torch.cuda.is_available() and "DRAFTFLOW_TORCH_THREADS" not in os.environ:
        torch.set_num_threads(1)
    elif "DRAFTFLOW_TORCH_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["DRAFTFLOW_TORCH_THREADS"]))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="draftflow", description="Train speculative-decoding drafters.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (("run", "run (or reuse) every stage"), ("plan", "show what a run would do")):
        s = sub.add_parser(name, help=text)
        s.add_argument("config", help="run config YAML, e.g. configs/tiny.yaml")
        s.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value by dotted path, e.g. train.lr=1e-3")
    s = sub.add_parser("refresh", help="take new traffic, train warm from the promoted drafter, promote if it is "
                       "better (nothing when no log file is new)")
    s.add_argument("config", help="run config YAML (its root holds the promoted drafter and the watermark)")
    s.add_argument("--traffic", default=None, metavar="PATH",
                   help="folder or s3:// prefix of JSONL request logs (else refresh.traffic)")
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value by dotted path, as for run")
    s = sub.add_parser("history", help="one line per refresh of a run root: tau, the live drafter's, promoted or not")
    s.add_argument("root", help="a run folder (e.g. runs/tiny, or s3://…) or the run's config YAML")
    s = sub.add_parser("status", help="which stages of a run are complete, their counts and outputs")
    s.add_argument("run", help="a run folder (e.g. runs/tiny, or s3://…) or the run's config YAML")
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="with a config file: override a value by dotted path, as for run")
    s = sub.add_parser("server", help="start a local Prefect server with its UI")
    s.add_argument("--port", type=int, default=4200)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--ui-api-url", default=None,
                   help="the API URL the UI in a browser uses; default http://<host>:<port>/api")
    s = sub.add_parser("deploy", help="create the deployments: deployments/prefect.yaml's and one per stage "
                       "(all by default)")
    s.add_argument("--name", dest="names", action="append", default=[], metavar="DEPLOYMENT",
                   help="only this deployment, e.g. draftflow-stage/curate (repeatable)")
    s.add_argument("--gpu-slots", type=int, default=1,
                   help="slots of the `gpu` concurrency limit when it is created (GPUs on the box)")
    s.add_argument("--show", action="store_true", help="print the deployments as `prefect deploy` reads them; "
                   "needs no server")
    s = sub.add_parser("compare", help="tau and predicted speedup per category and DDTree budget across runs")
    s.add_argument("runs", nargs="+", metavar="RUN", help="a run root, an evaluate folder or a report.json")
    s.add_argument("--png", default=None, metavar="PATH", help="also draw the comparison as a PNG here")
    s.add_argument("--lines", action="store_true",
                   help="also print `rehearsal <kind>: tau ... speedup_b8 ...` per evaluation with a served speedup")
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="overrides for the RUNs given as config files")
    return p


def cmd_plan(args) -> int:
    from draftflow.config import load_config

    cfg = load_config(args.config, args.overrides)  # a config error answers before the stages are imported
    from draftflow.runs.plan import environment, plan, preflight

    target = preflight(cfg)
    env = environment(cfg)
    free = "unknown (object store)" if env["free_bytes"] is None else f"{_size(env['free_bytes'])} free"
    hw = ", ".join(f"{k} {v}" for k, v in env["hardware"].items())
    # stdout: one header line, then one line per stage (scripts and tests parse it); notes go to stderr.
    print(f"run {cfg.name}  root {cfg.root} ({free})  target {target.path} ({target.fingerprint})  devices: {hw}")
    for s in plan(cfg, target):
        print(f"  {s['stage']:<11} {s['state']:<9} {s['fingerprint'] or '':<16} rows {_num(s['rows']):>9}  "
              f"tokens {_num(s['tokens']):>11}  bytes {_size(s['bytes']):>10}  time {_duration(s['seconds']):>9}"
              f"  ({s['basis']})")
    print(f"free space at {env['root']}: {free}\nestimated times assume:", file=sys.stderr)
    for line in env["assumptions"]:
        print(f"  - {line}", file=sys.stderr)
    return 0


def cmd_run(args) -> int:
    from draftflow.config import load_config

    cfg = load_config(args.config, args.overrides)  # a config error answers before the stages are imported
    start = time.time()
    summary = _in_prefect(cfg, "pipeline")
    print_summary(summary)
    print(f"wall time {time.time() - start:.1f} s")
    return 0


def cmd_refresh(args) -> int:
    """`draftflow refresh`: one refresh (`flows/refresh.py`); the run's lines, then the refresh's history line."""
    from draftflow.config import load_config

    extra = [f"refresh.traffic={os.path.abspath(args.traffic) if '://' not in args.traffic else args.traffic}"] \
        if args.traffic else []
    cfg = load_config(args.config, [*args.overrides, *extra])
    from draftflow.refresh.preflight import check_refresh

    check_refresh(cfg)  # a missing traffic path or a deleted promoted drafter: one line, before Prefect starts
    start = time.time()
    result = _in_prefect(cfg, "refresh")
    if "nothing" in result:
        print(result["nothing"])
        return 0
    if "stages" in result:
        print_summary(result)
    print(result["history"])
    print(f"wall time {time.time() - start:.1f} s")
    return 0


def _in_prefect(cfg, what: str) -> dict:
    """Run the `pipeline` or `refresh` flow on `cfg` under the root's lease, Prefect's server (a temporary one when
    no PREFECT_API_URL is set), progress on the terminal and Ctrl-C handling; a refused root is one line."""
    from draftflow.runs.plan import preflight

    target = preflight(cfg)
    from draftflow.runlock import holding

    # The root's lease first: a second run on a busy root stops here, before Prefect starts.
    with holding(cfg.root, cfg.name, cfg.lock.wait_s, cfg.lock.ttl_s):
        server = _prefect_env()  # starts on the other core while this one imports the stages
        user_api = None if server else _user_api()
        _cpu_threads()
        from flows.apiwatch import watching
        from flows.tempserver import serving

        if what == "refresh":
            from flows.refresh import refresh as run_flow
        else:
            from flows.pipeline import pipeline as run_flow
        console.quiet_user_errors()
        with serving(server) as url, console.terminal_progress(), watching(url or user_api):
            try:
                return interruptible(run_flow, cfg)
            except OSError as exc:  # the root refused: name it (a failed write() names no file), and for a
                from draftflow.runs.plan import space_to_finish  # full device what the rest of the run needs
                from draftflow.store import USER_CAUSES, storage_cause, storage_error_message

                cause = storage_cause(exc)
                if cause not in USER_CAUSES:
                    raise
                where = getattr(exc, "filename", None) or f"the run root {cfg.root}"
                more = space_to_finish(cfg, target) if cause == "no_space" else ""
                raise DraftflowError(storage_error_message(exc, where) + more) from None


def cmd_server(args) -> int:
    """Run `prefect server start` as a child whose UI reaches its API on any host and port, forwarding
    SIGTERM and SIGINT to it and exiting when it exits (a killed draftflow server leaves no server)."""
    _prefect_settings()
    from flows.deploy import prefect_command

    shown = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    api = args.ui_api_url or f"http://{shown}:{args.port}/api"
    cmd = [*prefect_command(), "server", "start", "--host", args.host, "--port", str(args.port)]
    # The UI asks the server which API to call; without this it is told 127.0.0.1:4200 on every port.
    env = {**os.environ, "PREFECT_UI_API_URL": api, "PREFECT_SERVER_UI_API_URL": api}
    print(f"UI at {api.removesuffix('/api')}; in another shell: export PREFECT_API_URL={api}, "
          "then draftflow run / deploy", file=sys.stderr)
    return run_forwarding_signals(cmd, env)


def run_forwarding_signals(cmd: list[str], env: dict[str, str]) -> int:
    """Run `cmd`, pass SIGTERM/SIGINT on to it, and return its exit code once it has exited."""
    import signal

    child = subprocess.Popen(cmd, env=env)
    forward = lambda signum, frame: child.send_signal(signum)  # noqa: E731
    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return child.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def cmd_compare(args) -> int:
    """The evaluations' figures side by side (`draftflow.runs.compare`); reads report.json files only."""
    from draftflow.runs.compare import compare

    print(compare(args.runs, args.png, args.lines, args.overrides))
    return 0


def cmd_deploy(args) -> int:
    _prefect_settings()
    from flows.deploy import deploy, show

    if args.show:
        print(show(), end="")
        return 0
    return deploy(args.names, args.gpu_slots)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handler = {"run": cmd_run, "refresh": cmd_refresh, "history": cmd_history, "plan": cmd_plan,
               "status": cmd_status, "server": cmd_server, "deploy": cmd_deploy, "compare": cmd_compare}[args.command]
    try:
        return handler(args)
    except RunInterrupted as exc:
        end_interrupted(exc)
    except DraftflowError as exc:
        print(f"draftflow: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # storage refused: OSErrors, and botocore's errors (which are not OSErrors)
        if not isinstance(exc, OSError) and type(exc).__module__.split(".")[0] not in console.STORAGE_LIBRARIES:
            raise
        from draftflow.store import storage_error_message

        print(f"draftflow: error: {storage_error_message(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
