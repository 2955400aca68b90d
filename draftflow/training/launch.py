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

Several nodes (`train.nnodes`): every node runs the same torchrun command (the parent logs it)
and c10d assigns ranks, so rank 0 may run on any node. On a local root the launch folder must be
reachable from every node (a shared filesystem). On a remote root nothing is shared but the store:
the launch folder (spec, result, error files, rank 0's final files) lives in the store
(`Exchange`), each node trains in its own local work folder (`spec["node_work"]`, under its
`DRAFTFLOW_CACHE`), every node resumes from the newest checkpoint copied to the store
(`draftflow.training.mirror.align_with_store`), and rank 0 publishes the trained drafter to the
store before a barrier lets any rank exit, so the parent finds it whichever node held rank 0.

What it does not know: Prefect, stages (the spec is what the train stage passes; the child runs
`draftflow.training.job`, imported lazily so the parent does not load it), the model.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from draftflow.config import TrainConfig
from draftflow.errors import ConfigError, DraftflowError
from draftflow.training.distributed import torchrun_command
from draftflow.training.supervise import AGENT_GRACE_S, AGENT_KILLED, run_streaming

log = logging.getLogger(__name__)
LAUNCH_DIR = "launch"


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
    exchange = Exchange(spec.get("exchange") or str(folder))
    exchange.clear()  # only this attempt's files may speak for it
    spec_url = exchange.write_json("spec.json", spec)
    cmd = torchrun_command(tcfg, "draftflow.training.launch", [spec_url])
    if tcfg.nnodes > 1:
        where = "" if exchange.remote else f", with {work} reachable there (a shared filesystem)"
        log.info("multi-node training: run on every other node%s: %s", where, " ".join(cmd))
    log_path = folder / "torchrun.log"
    rc, tail = run_streaming(cmd, log_path, tcfg.timeout_s, failed=lambda: bool(exchange.errors()))
    if rc != 0:
        raise _failure(rc, exchange, log_path, tail, tcfg)
    result = exchange.read_json("result.json")
    if result is None:
        raise TrainingCrashed(f"torchrun exited 0 but rank 0 wrote no {exchange.url}/result.json; see {log_path}")
    if exchange.remote:  # rank 0 may have run on another node: its drafter comes through the store
        exchange.fetch(work)
    return result


class Exchange:
    """The launch folder the parent and every rank share: spec, result, error files, rank 0's outputs.

    A local folder (one node, or several on a shared filesystem), or a folder in the store
    (`s3://…`) on remote roots, where one PUT per file never exposes a partial object. Listings
    are re-read every time: another node writes here.
    """

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.fs, self.path = fsspec.core.url_to_fs(self.url)
        self.remote = not isinstance(self.fs, LocalFileSystem)

    def _at(self, name: str) -> str:
        return f"{self.path}/{name}"

    def write_json(self, name: str, data: dict[str, Any]) -> str:
        """Write `name` whole (atomically); return its URL."""
        if not self.remote:
            return str(_write_json_atomic(Path(self._at(name)), data))
        self.fs.pipe_file(self._at(name), json.dumps(data, indent=2, sort_keys=True).encode())
        return self.fs.unstrip_protocol(self._at(name))

    def read_json(self, name: str) -> dict[str, Any] | None:
        self.fs.invalidate_cache()
        return json.loads(self.fs.cat_file(self._at(name))) if self.fs.exists(self._at(name)) else None

    def errors(self) -> list[dict[str, Any]]:
        self.fs.invalidate_cache()
        return [json.loads(self.fs.cat_file(p)) for p in self.fs.glob(self._at("error-rank*.json"))]

    def clear(self) -> None:
        """Remove a previous attempt's result, error files and outputs."""
        self.fs.invalidate_cache()
        for path in [self._at("result.json"), self._at("out"), *self.fs.glob(self._at("error-rank*.json"))]:
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)

    def publish(self, out_dir: str) -> None:
        """Rank 0, remote: copy the drafter's files (`out_dir`'s top level) and the target's config here."""
        for f in sorted(Path(out_dir).iterdir()):
            if f.is_file():
                self.fs.put_file(str(f), self._at(f"out/{f.name}"))
        self.fs.put_file(str(Path(out_dir) / LAUNCH_DIR / "target" / "config.json"), self._at("out/target/config.json"))

    def fetch(self, work: str) -> None:
        """The parent, remote: rank 0's published files into the local work folder, where rank 0 puts them."""
        (Path(work) / LAUNCH_DIR / "target").mkdir(parents=True, exist_ok=True)
        self.fs.get_file(self._at("out/target/config.json"), str(Path(work) / LAUNCH_DIR / "target" / "config.json"))
        for p in self.fs.ls(self._at("out"), detail=False):
            if self.fs.isfile(p):
                self.fs.get_file(p, str(Path(work) / p.rstrip("/").rsplit("/", 1)[-1]))


def _failure(rc: int, folder: Path | Exchange, log_path: Path, tail: list[str], tcfg: TrainConfig) -> Exception:
    """The one-line error for a failed launch, from the rank that failed first (on any node).

    A user error on any rank wins: when one rank raises, its peers fail inside their next
    collective ("connection closed by peer") and write error files of their own, which
    must not turn a bad input into a retried crash. Otherwise the earliest error counts.
    """
    exchange = folder if isinstance(folder, Exchange) else Exchange(str(folder))
    errors = sorted(exchange.errors(), key=lambda e: (not e["user_error"], e["time"]))
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
    how = (f"torchrun, still running {AGENT_GRACE_S:g} s after a rank failed, was killed" if rc == AGENT_KILLED
           else f"exit code {rc}")
    return kind(f"training under torchrun failed ({how}; {what}); full log: {log_path}")


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
    folder, _, name = args[0].rpartition("/")  # a local path or a URL in the store
    exchange = Exchange(folder or ".")
    try:
        _run_rank(exchange.read_json(name), exchange, rank)
    except BaseException as exc:  # noqa: BLE001  (reported to the parent, then a non-zero exit)
        log.exception("rank %d failed", rank)
        message = " ".join(str(exc).split()) or repr(exc)
        exchange.write_json(f"error-rank{rank}.json", {"rank": rank, "type": type(exc).__name__, "message": message,
                                                       "user_error": isinstance(exc, DraftflowError),
                                                       "time": time.time()})
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _run_rank(spec: dict[str, Any] | None, exchange: Exchange, rank: int) -> None:
    from draftflow.config import RunConfig
    from draftflow.contracts import read_feature_source
    from draftflow.kept import default_cache_dir
    from draftflow.store import Store
    from draftflow.training.job import train_here

    if spec is None:
        raise ConfigError(f"no spec.json in {exchange.url}: start the train stage on the first node, then run "
                          "the command it logs on the others")
    cfg = _bind_device(RunConfig.model_validate(spec["config"]))
    store = Store(cfg.root)
    out = spec["out_dir"]
    if spec.get("node_work"):  # several nodes on a remote root: this node's own work folder, aligned with the store
        out = str(default_cache_dir() / spec["node_work"])
        _align_checkpoints(store, cfg, spec["mirror"], out)
    trained = train_here(store, cfg, _node_target(cfg, spec["target"]), read_feature_source(spec["features"]),
                         out, spec.get("mirror"))
    if rank == 0:
        (Path(out) / LAUNCH_DIR / "target").mkdir(parents=True, exist_ok=True)
        trained.target_config.to_json_file(str(Path(out) / LAUNCH_DIR / "target" / "config.json"))
        if exchange.remote:
            exchange.publish(out)
        exchange.write_json("result.json", {"metrics": trained.metrics, "rows": trained.rows,
                                            "tokens": trained.tokens})
    _barrier()  # no node's torchrun exits (and ends the parent's wait) before rank 0 has published
    if spec.get("node_work") and int(os.environ.get("LOCAL_RANK", "0")) == 0 and not _first_nodes(spec, out):
        shutil.rmtree(out, ignore_errors=True)  # another node's work folder: the first node commits the outputs


def _first_nodes(spec: dict[str, Any], out: str) -> bool:
    """Whether `out` is the work folder the parent (the train stage) commits from: its host, its path."""
    import socket

    return (socket.gethostname(), out) == (spec.get("first_node"), spec["out_dir"])


def _align_checkpoints(store, cfg, mirror: str, out: str) -> None:
    """Local rank 0 makes the store's newest checkpoint this node's newest; the node's ranks wait for it."""
    import torch

    from draftflow.target import resolve_device
    from draftflow.training.distributed import init_distributed
    from draftflow.training.mirror import align_with_store

    init_distributed(torch.device(resolve_device(cfg.train.device)), cfg.train.collective_timeout_s)  # training's
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        align_with_store(store, mirror, out)
    _barrier()


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _node_target(cfg, ref: dict[str, str]):
    """The target as the parent resolved it; the built-in tiny target and a GGUF target's converted folder are
    made again in this node's cache when the parent's copy is not on this node (a hub id or a folder at the
    same path on every node is used as is)."""
    from draftflow.gguf_target import is_gguf, target_label
    from draftflow.target import TargetRef, resolve_target

    made_here = cfg.target.path is None or is_gguf(cfg.target)  # built or converted into a cache
    if not made_here or Path(ref["path"]).exists():
        return TargetRef(**ref)
    built = resolve_target(cfg.target)
    if built.fingerprint == ref["fingerprint"]:
        return built
    if is_gguf(cfg.target):
        raise ConfigError(f"the GGUF target {target_label(cfg.target)} converted on this node ({built.fingerprint}) "
                          f"differs from the first node's ({ref['fingerprint']}); give every node the same .gguf "
                          "file (same bytes) and the same target.dtype")
    raise ConfigError(f"the tiny target built on this node ({built.fingerprint}) differs from the first "
                      f"node's ({ref['fingerprint']}); install the same draftflow version on every node")


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
