"""Deployments: the work pools and the GPU concurrency limit they rely on, and the GPU slot stages take.

GPU stages (regenerate, extract, train, evaluate) hold `DRAFTFLOW_GPUS` slots (default 1) of the
Prefect global concurrency limit named by `DRAFTFLOW_GPU_LIMIT` while they run, with `strict=True`,
so two stages never share a GPU by accident and a missing limit is an error rather than a warning.
The variable is set by the `gpu` pool's deployments (`deployments/prefect.yaml`); without it (`make
demo`, tests, a laptop) no slot is taken, so the ephemeral no-server run needs no setup.
`draftflow deploy` creates the pools and the limit when they are missing (`ensure_infrastructure`).

The deployments: `deployments/prefect.yaml` holds the whole-pipeline ones (weekly, manual, the nightly
data refresh) and the pools' settings; one deployment per stage is generated from the stage registry
(`stage_deployments`: its pool from the stage's `gpu`, its description from `about`), so a new stage is
deployable without an edit here. `draftflow deploy --show` prints the whole file `prefect deploy` reads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from draftflow.errors import DraftflowError

ROOT = Path(__file__).resolve().parent.parent
PREFECT_FILE = ROOT / "deployments" / "prefect.yaml"
GPU_LIMIT_ENV, GPU_COUNT_ENV = "DRAFTFLOW_GPU_LIMIT", "DRAFTFLOW_GPUS"
GPU_IMAGE = "draftflow:gpu"  # the gpu pool's image job variable unless DRAFTFLOW_GPU_IMAGE is set
POOLS = {"cpu": "process", "gpu": "process"}  # name -> type created when missing (kubernetes/docker: by hand)


def prefect_command() -> list[str]:
    """The `prefect` CLI of this interpreter's environment (it need not be on PATH)."""
    beside = Path(sys.executable).parent / "prefect"
    return [str(beside)] if beside.exists() else ["prefect"]


def gpu_slot(gpus: int = 1):
    """A context holding GPU slots for a stage the registry runs on GPU workers, or nothing when
    `DRAFTFLOW_GPU_LIMIT` is unset (make demo, tests, a laptop: no setup needed).

    The limit counts the GPU pool's jobs, so a GPU stage holds its slots whatever device it finds on its
    worker (its task runs are tagged by that device: `registry.device_tags`).
    `gpus`: how many GPUs the stage itself uses (torchrun processes, a vLLM tensor-parallel group);
    it takes the larger of that and `DRAFTFLOW_GPUS`, so an 8-GPU training run holds 8 slots.
    """
    name = os.environ.get(GPU_LIMIT_ENV)
    if not name:
        return nullcontext()
    return _occupy(name, max(gpus, int(os.environ.get(GPU_COUNT_ENV, "1"))))


@contextmanager
def _occupy(name: str, slots: int):
    from prefect import get_run_logger
    from prefect.concurrency.sync import concurrency

    with concurrency(name, occupy=slots, strict=True):
        get_run_logger().info("holding %d slot(s) of the GPU concurrency limit %r", slots, name)
        yield


def ensure_infrastructure(gpu_slots: int, limit: str = "gpu") -> list[str]:
    """Create the `cpu`/`gpu` work pools and the GPU concurrency limit where missing; say what was made."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    made = []
    with get_client(sync_client=True) as client:
        for pool, kind in POOLS.items():
            try:
                client.read_work_pool(pool)
            except ObjectNotFound:
                client.create_work_pool(WorkPoolCreate(
                    name=pool, type=kind, base_job_template=ProcessWorker.get_default_base_job_template()))
                made.append(f"work pool {pool} ({kind})")
        try:
            client.read_global_concurrency_limit_by_name(limit)
        except ObjectNotFound:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=limit, limit=gpu_slots))
            made.append(f"global concurrency limit {limit} ({gpu_slots} slot{'s' * (gpu_slots != 1)})")
    return made


def check_server() -> str:
    """The API URL deployments go to; a missing setting or an unreachable server is a one-line error."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise DraftflowError("PREFECT_API_URL is not set: start a server (draftflow server) and "
                             "export PREFECT_API_URL=http://127.0.0.1:4200/api")
    import httpx

    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=10).raise_for_status()
    except httpx.HTTPError as exc:
        raise DraftflowError(f"no Prefect server answers at {url} ({type(exc).__name__}); "
                             "start one with `draftflow server`") from None
    return url


STAGE_ENTRYPOINT = "flows/pipeline.py:stage_from_file"


def stage_deployments(defs: dict[str, Any]) -> list[dict[str, Any]]:
    """One deployment per registry stage: it runs that stage with `upstream: reuse`, on the `gpu` pool when the
    stage uses a GPU, else on `cpu`. `defs`: prefect.yaml's `definitions` (the pools, default parameters)."""
    from draftflow.stages.registry import registry

    out = []
    for s in registry():
        needs = f" Needs {', '.join(s.upstream)} complete." if s.upstream else ""
        out.append({"name": s.name, "description": (s.about + needs).strip(), "entrypoint": STAGE_ENTRYPOINT,
                    "parameters": {**defs["parameters"], "stage": s.name, "upstream": "reuse"},
                    "work_pool": defs["gpu" if s.gpu else "cpu"]})
    return out


def deployment_spec() -> dict[str, Any]:
    """The deployments `draftflow deploy` creates: prefect.yaml's, then one per stage (`stage_deployments`)."""
    import yaml

    spec = yaml.safe_load(PREFECT_FILE.read_text())
    stages = stage_deployments(spec["definitions"])
    clash = {d["name"] for d in spec["deployments"]} & {d["name"] for d in stages}
    if clash:
        raise DraftflowError(f"deployment {sorted(clash)[0]!r} is in {PREFECT_FILE.relative_to(ROOT)} and is a stage "
                             "of the registry; rename the one in the file")
    spec["deployments"] = spec["deployments"] + stages
    return spec


def show(spec: dict[str, Any] | None = None) -> str:
    """The deployment file `prefect deploy` reads (default: `deployment_spec()`), as YAML without aliases."""
    import yaml

    class Plain(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return yaml.dump(spec or deployment_spec(), Dumper=Plain, sort_keys=False, width=120)


def _known(spec: dict[str, Any], names: list[str]) -> list[str]:
    """Deployment names as prefect.yaml spells them (`draftflow-stage/curate` -> `curate`); unknown: an error."""
    declared = [d["name"] for d in spec["deployments"]]
    short = [n.split("/")[-1] for n in names]
    unknown = [n for n, s in zip(names, short) if s not in declared]
    if unknown:
        raise DraftflowError(f"no deployment {unknown[0]!r} in {PREFECT_FILE.relative_to(ROOT)} or the stage "
                             f"registry; choose from {', '.join(declared)}")
    return short


def deploy(names: list[str], gpu_slots: int) -> int:
    """`prefect deploy` the named deployments (all when none): prefect.yaml's and one per stage."""
    spec = deployment_spec()
    select = [a for n in _known(spec, names) for a in ("--name", n)] or ["--all"]
    url = check_server()
    for line in ensure_infrastructure(gpu_slots):
        print(f"created {line} at {url}")
    env = dict(os.environ)
    env.setdefault("DRAFTFLOW_HOME", str(ROOT))  # the pull step's working directory on the worker
    env.setdefault("DRAFTFLOW_GPU_IMAGE", GPU_IMAGE)
    with tempfile.TemporaryDirectory(prefix="draftflow-deploy-") as tmp:
        generated = Path(tmp) / "prefect.yaml"
        generated.write_text(show(spec))
        cmd = [*prefect_command(), "--no-prompt", "deploy", *select, "--prefect-file", str(generated)]
        return subprocess.call(cmd, cwd=ROOT, env=env)
