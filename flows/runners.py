"""Where a stage flow's shard tasks run: a thread pool in the flow's process, or Ray.

The choice comes from the run config's `runner` section. Prefect enters a flow's task
runner before the flow's parameters are in context, so `StageTaskRunner` (the runner on
every stage flow's decorator) picks the real one when the flow submits its first task,
from the flow's `cfg` parameter. The section chooses placement only: results, cache keys
and fingerprints are the same whichever runner ran a shard (tests/test_ray.py compares
the manifests of a thread run and a Ray run).

On Ray, a task tagged `gpu` asks for `runner.gpus_per_task` GPUs (Ray then sets its
CUDA_VISIBLE_DEVICES) and every task for `runner.cpus_per_task` CPUs (Ray sets
OMP_NUM_THREADS to it, so torch in the worker uses that many threads). `prefect-ray` and
`ray` are imported only when a run asks for Ray.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from prefect.context import FlowRunContext
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from draftflow.config import RunConfig, RunnerConfig
from draftflow.errors import ConfigError
from draftflow.stages.registry import spec

log = logging.getLogger(__name__)
# A locally started instance: tasks pass small manifests, never data, so a small object store is plenty
# (Ray's default takes 30% of RAM in /dev/shm).
LOCAL_OBJECT_STORE_BYTES = 256 << 20
CONNECT_TIMEOUT_S = 5.0
NODE_POLL_S = 2.0  # node_watch: how often it asks the cluster which nodes are alive


def _prefect_ray():
    try:
        import prefect_ray.context
        import prefect_ray.task_runners
    except ImportError:
        raise ConfigError("runner.kind=ray needs prefect-ray and ray: pip install 'draftflow[ray]' "
                          "(or set runner.kind=thread)") from None
    return prefect_ray


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of `ray://host:port` or `host:port`; None for `auto` or an address without a port."""
    rest = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = rest.rpartition(":")
    return (host, int(port)) if sep and host and port.isdigit() else None


def _check_reachable(address: str) -> None:
    hp = _host_port(address)
    if hp is None:
        return
    try:
        socket.create_connection(hp, timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise ConfigError(f"runner.ray_address={address!r} is unreachable ({exc.strerror or exc}); start the "
                          "cluster (ray start --head) or fix the address") from None


def gpu_shortfall(runner: RunnerConfig, cluster_gpus: float) -> str | None:
    """Why gpu tasks could never be scheduled on a cluster with `cluster_gpus` GPUs, or None."""
    if runner.gpus_per_task <= cluster_gpus:
        return None
    return (f"runner.gpus_per_task={runner.gpus_per_task:g} but the Ray cluster has {cluster_gpus:g} GPUs; "
            "set runner.gpus_per_task=0 to run GPU-stage tasks on CPUs, or add GPU nodes")


def connect_ray(runner: RunnerConfig, gpu_tasks: bool = True) -> None:
    """Connect to `runner.ray_address`, or start a local instance (unless Ray is already up), then
    check that a gpu task fits on the cluster.

    Raises:
        ConfigError: prefect-ray missing, the address unreachable, or (local instance) fewer GPUs
            than one gpu task asks for: each is one line.
    """
    _prefect_ray()
    import ray

    started = not ray.is_initialized()
    if started:
        _init_ray(runner.ray_address)
    short = gpu_shortfall(runner, ray.cluster_resources().get("GPU", 0.0)) if gpu_tasks else None
    if short and runner.ray_address is None:  # a local instance never grows: tasks would wait forever
        if started:
            ray.shutdown()
        raise ConfigError(short)
    if short:  # an autoscaler may still add GPU nodes
        log.warning("%s (tasks wait until GPU nodes join)", short)


def _init_ray(address: str | None) -> None:
    import ray

    kwargs: dict[str, Any] = {"namespace": "prefect", "include_dashboard": False}
    if address is None:
        kwargs["object_store_memory"] = LOCAL_OBJECT_STORE_BYTES
    elif address != "auto":
        _check_reachable(address)
    term = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(address, **kwargs)
    except Exception as exc:  # ConnectionError, RuntimeError, ValueError: all mean "no cluster there"
        raise ConfigError(_connect_error(address, exc)) from None
    finally:
        # ray.init installs a C++ handler for SIGTERM that prints a stack and kills the process at once: the
        # run's own (flows.signals) must stay, to stop in one line with the lease released.
        if term is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, term)


def _connect_error(address: str | None, exc: BaseException) -> str:
    """One line for a failed `ray.init`: its deepest cause, which says why.

    Ray's own message only names the GCS address it tried ("Failed to connect to Ray cluster at
    ip:port", the loopback already replaced by this machine's IP), whatever the reason; the cause
    chain holds the reason. A rejected auth token gets what to do: a process reads Ray's token once
    and caches it, so it must be in the environment before the process first uses Ray.
    """
    root = exc
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    lines = [ln.strip() for ln in str(root).strip().splitlines() if ln.strip()]
    why = lines[-1] if lines else type(root).__name__  # a chained traceback's last line is its error
    if type(root).__name__ == "AuthenticationError" or "InvalidAuthToken" in why:
        return (f"runner.ray_address={address!r}: the Ray cluster rejected this process's auth token; set "
                "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or ~/.ray/auth_token) to the cluster's token before "
                "the run starts (Ray reads it once per process)")
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return f"runner.ray_address={address!r}: cannot connect to Ray ({first}: {why[:300]})"


@contextlib.contextmanager
def node_watch(runner: RunnerConfig, stage: str, gpu: bool) -> Iterator[None]:
    """While a stage's tasks may run on Ray: stop the run (`flows.signals.stop_run`) when for
    `runner.node_wait_s` no alive node has the CPUs (and GPUs) one task asks for.

    Ray retries the tasks of a lost node on another one, and waits for a node when none fits: on
    a fixed cluster that lost its only worker (killed, or cut off until its raylet is declared
    dead) the run would wait forever. A warning line says when the wait starts.
    """
    import ray

    need = {"CPU": float(runner.cpus_per_task), "GPU": runner.gpus_per_task if gpu else 0.0}
    done = threading.Event()

    def fits() -> bool:
        try:
            nodes = ray.nodes()
        except Exception:  # noqa: BLE001  (the head cannot answer: no node can be counted on)
            return False
        return any(n.get("Alive") and all(n.get("Resources", {}).get(k, 0.0) >= v for k, v in need.items() if v)
                   for n in nodes)

    def watch() -> None:
        from flows.signals import stop_run

        since = None
        while not done.wait(NODE_POLL_S):
            if fits():
                since = None
                continue
            now = time.monotonic()
            if since is None:
                since = now
                log.warning("%s: no alive Ray node can run a task (%s); waiting up to runner.node_wait_s=%g s for "
                            "one to join", stage, _asks(need), runner.node_wait_s)
            elif now - since >= runner.node_wait_s and not done.is_set():
                stop_run(f"{stage}: no alive Ray node could run a task ({_asks(need)}) for runner.node_wait_s="
                         f"{runner.node_wait_s:g} s; start a worker node (ray start --address=<head>)")
                return

    if runner.node_wait_s is not None:
        threading.Thread(target=watch, name=f"draftflow-ray-nodes-{stage}", daemon=True).start()
    try:
        yield
    finally:
        done.set()


def _asks(need: dict[str, float]) -> str:
    return " and ".join(f"{v:g} {k}" for k, v in need.items() if v)


def task_runner_for(cfg: RunConfig, stage: str, default_workers: int | None = None) -> TaskRunner:
    """The (not yet entered) task runner for `stage`'s shard tasks under `cfg.runner`."""
    runner = cfg.runner
    if runner.kind == "thread" or stage not in runner.stages:
        return ThreadPoolTaskRunner(max_workers=runner.max_workers or default_workers)
    if stage == "regenerate" and cfg.regenerate.engine == "vllm":
        tp = cfg.regenerate.vllm.tensor_parallel_size
        if runner.gpus_per_task < tp:
            raise ConfigError(f"runner.gpus_per_task={runner.gpus_per_task:g} is less than "
                              f"regenerate.vllm.tensor_parallel_size={tp}: one task holds a whole tensor-parallel "
                              "group; raise runner.gpus_per_task")
    connect_ray(runner, gpu_tasks=spec(stage).gpu == "shards")  # its shard tasks are tagged `gpu`
    return _prefect_ray().task_runners.RayTaskRunner(address=runner.ray_address)


def _flow_config() -> RunConfig | None:
    ctx = FlowRunContext.get()
    cfg = ctx.parameters.get("cfg") if ctx is not None else None
    if cfg is None or isinstance(cfg, RunConfig):
        return cfg
    return RunConfig.model_validate(cfg)


def _api_url() -> str | None:
    """The Prefect API this process talks to, including the temporary server of a run without one."""
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    if url:
        return url
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    return server.api_url if server.running else None


class StageTaskRunner(TaskRunner):
    """A stage flow's task runner: threads or Ray, as the flow's `cfg.runner` says.

    Args:
        stage: the stage whose shard tasks this flow maps (matched against `runner.stages`).
        max_workers: the thread-pool size when `runner.max_workers` is unset (None: Prefect's default).
    """

    def __init__(self, stage: str, max_workers: int | None = None):
        super().__init__()
        self.stage, self.max_workers = stage, max_workers
        self._inner: TaskRunner | None = None
        self._runner = RunnerConfig()
        self._exits = contextlib.ExitStack()
        self._lock = threading.Lock()

    def duplicate(self) -> StageTaskRunner:
        return type(self)(self.stage, self.max_workers)

    def __reduce__(self):
        # Ray pickles the flow (and so its task runner) into each task's context: settings only.
        return type(self), (self.stage, self.max_workers)

    def _resolve(self) -> TaskRunner:
        with self._lock:
            if self._inner is None:
                cfg = _flow_config() or RunConfig()
                self._runner = cfg.runner
                self._inner = self._exits.enter_context(task_runner_for(cfg, self.stage, self.max_workers))
                if self._runner.kind == "ray" and self.stage in self._runner.stages and self._runner.ray_address:
                    self._exits.enter_context(node_watch(self._runner, self.stage, spec(self.stage).gpu == "shards"))
        return self._inner

    def _placement(self, task) -> contextlib.AbstractContextManager:
        """On Ray: the task's resource request, and the API URL its worker reports to."""
        if self._runner.kind != "ray" or self.stage not in self._runner.stages:
            return contextlib.nullcontext()
        from prefect.settings import PREFECT_API_URL, temporary_settings

        ctx = _prefect_ray().context.RemoteOptionsContext
        gpus = self._runner.gpus_per_task if "gpu" in task.tags else 0
        own = {"num_cpus": self._runner.cpus_per_task, "num_gpus": gpus}
        stack = contextlib.ExitStack()
        # Options set by code around the call (prefect_ray.context.remote_options) win over the config's.
        stack.enter_context(ctx(current_remote_options={**own, **ctx.get().current_remote_options}))
        url = _api_url()
        if url:  # serialized into the task's context: workers report to this server, not one of their own
            stack.enter_context(temporary_settings(updates={PREFECT_API_URL: url}))
        return stack

    def submit(self, task, parameters, wait_for=None, dependencies=None):
        inner = self._resolve()
        with self._placement(task):
            return inner.submit(task, parameters, wait_for=wait_for, dependencies=dependencies)

    def map(self, task, parameters, wait_for=None):
        self._resolve()
        return super().map(task, parameters, wait_for)  # one self.submit per item

    def __exit__(self, *exc_info: Any) -> None:
        try:
            self._exits.__exit__(*exc_info)
        finally:
            self._inner = None
            super().__exit__(*exc_info)
