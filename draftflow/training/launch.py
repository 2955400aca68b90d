"""Training in torchrun child processes: the launch spec, the child entry point, the parent's launcher.

The train stage writes a spec (JSON, atomically) into `<work>/launch/` and runs

    python -m torch.distributed.run --nproc-per-node=N ... -m draftflow.training.launch <work>/launch/spec.json

Each rank loads the target and the samples itself (`draftflow.training.job.train_here`, the
same function the in-process path runs), trains its share of every step, and rank 0 writes
the checkpoints, the final drafter and `launch/result.json` (metrics, counts, the target's
config). The parent streams the children's output into `launch/torchrun.log` and its logger,
and waits. A failing rank writes `launch/error-rank<R>.json`; the parent then raises one line
naming the exit code, the first failing rank's error and the log file. A user error in the
child (a `DraftflowError`: bad config, missing shard, divergence) raises `DraftflowError`,
which Prefect does not retry; anything else (a signal, out of memory, a timeout) raises
`TrainingCrashed`, which it retries, resuming from the last checkpoint.

When (`use_torchrun`): `train.launcher=torchrun` always; `auto` when training needs more than
one process or runs on CUDA (its own process gives a hard timeout, `train.timeout_s`, and
returns all GPU memory when it exits); otherwise in-process (CPU, one process: tests, demo).

What it does not know: Prefect, stages (the spec is what the train stage passes; the child runs
`draftflow.training.job`, imported lazily so the parent does not load it), the model.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from draftflow.config import TrainConfig
from draftflow.errors import ConfigError, DraftflowError
from draftflow.training.distributed import torchrun_command

log = logging.getLogger(__name__)
LAUNCH_DIR = "launch"
TAIL_LINES = 20


class TrainingCrashed(RuntimeError):
    """Training processes died without a user error (signal, out of memory, timeout): retryable."""


def use_torchrun(tcfg: TrainConfig) -> bool:
    """Whether the train stage runs training in torchrun child processes (see the module docstring).

    Raises:
        ConfigError: `launcher=inprocess` with more than one process.
    """
    from draftflow.target import resolve_device

    many = tcfg.nproc_per_node * tcfg.nnodes > 1
    if tcfg.launcher == "inprocess" and many:
        raise ConfigError(f"train.launcher=inprocess runs one process but train.nproc_per_node={tcfg.nproc_per_node}"
                          f" x train.nnodes={tcfg.nnodes}; set train.launcher=auto (torchrun) or use 1 process")
    if tcfg.launcher != "auto":
        return tcfg.launcher == "torchrun"
    return many or resolve_device(tcfg.device).startswith("cuda")


# ----------------------------------------------------------------------------- parent


def launch_training(spec: dict[str, Any], tcfg: TrainConfig, work: str) -> dict[str, Any]:
    """Run `spec` under torchrun on this node; return rank 0's `result.json`.

    Args:
        spec: what every rank needs (JSON data): see `draftflow.stages.train.train_in_children`.
        tcfg: the `train` section (processes, nodes, rendezvous, timeout).
        work: the training work folder; gets `launch/` (spec, log, result, error files).

    Raises:
        DraftflowError: a rank failed with a user error.
        TrainingCrashed: a rank died otherwise, or `train.timeout_s` passed.
    """
    folder = Path(work) / LAUNCH_DIR
    folder.mkdir(parents=True, exist_ok=True)
    for stale in [folder / "result.json", *folder.glob("error-rank*.json")]:
        stale.unlink(missing_ok=True)  # only this attempt's files may speak for it
    spec_path = _write_json_atomic(folder / "spec.json", spec)
    cmd = torchrun_command(tcfg, "draftflow.training.launch", [str(spec_path)])
    if tcfg.nnodes > 1:
        log.info("multi-node training: run on every other node, with %s reachable there: %s", work, " ".join(cmd))
    log_path = folder / "torchrun.log"
    rc, tail = _run_streaming(cmd, log_path, tcfg.timeout_s)
    if rc != 0:
        raise _failure(rc, folder, log_path, tail, tcfg)
    result = folder / "result.json"
    if not result.is_file():
        raise TrainingCrashed(f"torchrun exited 0 but rank 0 wrote no {result}; see {log_path}")
    return json.loads(result.read_text())


def _run_streaming(cmd: list[str], log_path: Path, timeout_s: float | None) -> tuple[int, list[str]]:
    """Run `cmd` in its own process group; copy its output to `log_path` and the logger.

    Returns (exit code, or -1 after a timeout; the last lines). The group is killed on a
    timeout and when the parent is interrupted (a cancelled flow run leaves no trainers).
    """
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default too; 2-core CI would thrash without it
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    with open(log_path, "a") as logf:
        logf.write(f"$ {' '.join(cmd)}\n")
        logf.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        reader = threading.Thread(target=_copy_lines, args=(proc.stdout, logf, tail), daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc = -1
        except BaseException:
            _kill_group(proc)
            raise
        reader.join(timeout=30)
    return rc, list(tail)


def _copy_lines(stream, logf, tail) -> None:
    for line in stream:
        logf.write(line)
        logf.flush()
        tail.append(line.rstrip())
        log.info("%s", line.rstrip())


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM torchrun's process group (torchrun forwards it to the ranks), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _failure(rc: int, folder: Path, log_path: Path, tail: list[str], tcfg: TrainConfig) -> Exception:
    """The one-line error for a failed launch, from the rank that failed first.

    A user error on any rank wins: when one rank raises, its peers fail inside their next
    collective ("connection closed by peer") and write error files of their own, which
    must not turn a bad input into a retried crash. Otherwise the earliest error counts.
    """
    errors = sorted((json.loads(p.read_text()) for p in folder.glob("error-rank*.json")),
                    key=lambda e: (not e["user_error"], e["time"]))
    if rc == -1:
        return TrainingCrashed(f"training exceeded train.timeout_s={tcfg.timeout_s:g} s and was killed; "
                               f"it resumes from its last checkpoint on a retry; log: {log_path}")
    if errors:
        err = errors[0]
        what = f"rank {err['rank']}: {err['type']}: {err['message']}"
        kind = DraftflowError if err["user_error"] else TrainingCrashed
    else:
        last = next((line for line in reversed(tail) if line.strip()), "no output")
        what, kind = f"no rank reported an error (killed?); last output: {last}", TrainingCrashed
    return kind(f"training under torchrun failed with exit code {rc} ({what}); full log: {log_path}")


def _write_json_atomic(path: Path, data: dict[str, Any]) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)
    return path


# ----------------------------------------------------------------------------- child


def main(argv: list[str] | None = None) -> int:
    """Entry point of one rank: `python -m draftflow.training.launch <spec.json>` under torchrun."""
    args = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"[rank {rank}] %(asctime)s %(levelname)s %(name)s: %(message)s")
    if len(args) != 1:
        log.error("usage: python -m draftflow.training.launch <spec.json> (run by the train stage under torchrun)")
        return 2
    spec_path = Path(args[0])
    try:
        _run_rank(json.loads(spec_path.read_text()), spec_path.parent, rank)
    except BaseException as exc:  # noqa: BLE001  (reported to the parent, then a non-zero exit)
        log.exception("rank %d failed", rank)
        message = " ".join(str(exc).split()) or repr(exc)
        _write_json_atomic(spec_path.parent / f"error-rank{rank}.json",
                           {"rank": rank, "type": type(exc).__name__, "message": message,
                            "user_error": isinstance(exc, DraftflowError), "time": time.time()})
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _run_rank(spec: dict[str, Any], folder: Path, rank: int) -> None:
    from draftflow.config import RunConfig
    from draftflow.contracts import read_feature_source
    from draftflow.store import Store
    from draftflow.target import TargetRef
    from draftflow.training.job import train_here

    cfg = _bind_device(RunConfig.model_validate(spec["config"]))
    features = read_feature_source(spec["features"])
    trained = train_here(Store(cfg.root), cfg, TargetRef(**spec["target"]), features, spec["out_dir"],
                         spec.get("mirror"))
    if rank == 0:
        (folder / "target").mkdir(exist_ok=True)
        trained.target_config.to_json_file(str(folder / "target" / "config.json"))
        _write_json_atomic(folder / "result.json", {"metrics": trained.metrics, "rows": trained.rows,
                                                    "tokens": trained.tokens})


def _bind_device(cfg):
    """On CUDA, this rank's GPU (LOCAL_RANK) for the drafter and, when it is on CUDA, the target."""
    import torch

    from draftflow.target import resolve_device

    if not resolve_device(cfg.train.device).startswith("cuda"):
        return cfg
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = f"cuda:{local}"
    target = cfg.target
    if resolve_device(target.device).startswith("cuda"):
        target = target.model_copy(update={"device": dev})
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"device": dev}), "target": target})


if __name__ == "__main__":
    sys.exit(main())
