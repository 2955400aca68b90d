"""Two training nodes rehearsed on one machine, as they run on two real ones.

Each "node" is its own `torchrun --nnodes=2` (one process per node, c10d rendezvous on 127.0.0.1)
with its own local work folder (its own `DRAFTFLOW_CACHE`); the nodes share nothing but the run
root on S3 (moto's server): the features, the launch spec, the checkpoints and rank 0's drafter.
Node A is the train stage itself (`draftflow.stages.train.run`, as a flow would call it); node B
runs the command the stage logs for the other nodes. The weights equal a one-node run's with the
same global batch, and a node SIGKILLed mid-run (after the step-2 checkpoint reached the store)
resumes on both nodes from the store to the same final weights.

No fixed port and no sleeps: node B hosts the rendezvous on a port chosen free just before and is
started again on another one if that port was taken meanwhile; the kill waits for the checkpoint
to appear in the bucket, and node B's rank blocks at step 3 (tests/multinode_node.py) so the run
cannot finish first. Slow (2-3 min on 2 shared cores, each test under 2 min): three two-node launches,
each node a fresh interpreter that imports torch and transformers.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load

from draftflow.config import TrainConfig
from draftflow.stages import train as train_stage
from draftflow.store import Store
from draftflow.training.distributed import torchrun_command
from draftflow.training.launch import TrainingCrashed
from tests.conftest import ROOT, moto_s3, one_shard_features, stamped, tiny_config

BUCKET = "draftflow-nodes"
RUN = f"s3://{BUCKET}/run"
TRAIN = ["train.max_steps=4", "train.batch_size=3", "train.checkpoint_every=2", "train.num_anchors=8"]
DEADLINE_S = 600  # generous: a loaded 2-core machine; no assertion depends on it being met quickly


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_target):
    """The S3 server, features of one train shard on it, and the one-node run's weights."""
    node_a = tmp_path_factory.mktemp("node-a")
    with moto_s3(DRAFTFLOW_CACHE=str(node_a / "cache")):
        store = Store(RUN)
        store.fs.mkdir(BUCKET)
        cfg = tiny_config(RUN, *TRAIN)
        store, features = one_shard_features(cfg, tiny_target)
        one = _train(tiny_target, features, "fp-one")  # 1 node, 1 process: in-process
        assert one.extra["metrics"]["steps"] == 4
        yield {"features": features, "store": store, "one": _weights(store, "fp-one"), "tmp": tmp_path_factory}


def _train(tiny_target, features, fp, *overrides):
    cfg = tiny_config(RUN, *TRAIN, *overrides)
    return train_stage.run(Store(cfg.root), stamped("train", fp, {"extract": "d"}), cfg, tiny_target, features)


def _weights(store: Store, fp: str) -> dict[str, torch.Tensor]:
    return load(store.fs.cat_file(store.stage_path("train", fp, "checkpoint", "model.safetensors")))


def _assert_same_weights(a: dict, b: dict) -> None:
    assert set(a) == set(b) and a
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=2e-5, rtol=1e-4)


class NodeB:
    """The second node: `torchrun --nnodes=2` on the spec in the store, hosting the rendezvous."""

    def __init__(self, tmp: Path, fp: str, module: str = "draftflow.training.launch", **env: str):
        self.cache, self.log = tmp / "cache", tmp / f"node-b-{module.rsplit('.', 1)[-1]}.log"  # one per launch
        self.spec = train_stage.launch_url(Store(RUN), fp) + "/spec.json"
        self.module, self.env = (
            module,
            os.environ | {"DRAFTFLOW_CACHE": str(self.cache), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env},
        )
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def start(self) -> int:
        """Start it on a free port; return the port once it listens (again on another port if it was taken)."""
        for _ in range(5):
            self.port = _free_port()
            cmd = torchrun_command(
                TrainConfig(nnodes=2, rdzv_endpoint=f"127.0.0.1:{self.port}"), self.module, [self.spec]
            )
            cmd.insert(cmd.index("-m", 3), "--rdzv-conf=is_host=1")  # this node hosts the c10d store
            with open(self.log, "a") as log:
                self.proc = subprocess.Popen(
                    cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            if _wait_listening(self.port, self.proc):
                return self.port
            self.proc.wait()  # it exited: the port was taken between the choice and the bind
        raise AssertionError(f"node B never listened; see {self.log}")

    def kill(self) -> None:
        """SIGKILL the whole node: its torchrun agent and its rank (torchrun starts ranks in sessions of their own)."""
        for pid in [self.proc.pid, *_descendants(self.proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def wait(self) -> int:
        return self.proc.wait(timeout=DEADLINE_S)

    def output(self) -> str:
        return self.log.read_text()


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc), found before any is killed."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it exited meanwhile
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen) -> bool:
    """True once something accepts on `port` (node B's c10d store); False if node B exits first."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.1)  # polling a condition, not waiting a fixed time
    return False


def _two_nodes(node_b: NodeB) -> list[str]:
    return ["train.nnodes=2", f"train.rdzv_endpoint=127.0.0.1:{node_b.port}"]


def test_two_nodes_sharing_only_s3_equal_one_node(cluster, tiny_target, caplog):
    node_b = NodeB(cluster["tmp"].mktemp("node-b"), "fp-two")
    node_b.start()
    with caplog.at_level(logging.INFO, logger="draftflow.training.launch"):
        two = _train(tiny_target, cluster["features"], "fp-two", *_two_nodes(node_b))
    assert node_b.wait() == 0, node_b.output()[-3000:]
    ranks = {f"[rank {r}]" for r in (0, 1)}
    a_ranks, b_ranks = {r for r in ranks if r in caplog.text}, {r for r in ranks if r in node_b.output()}
    assert len(a_ranks) == len(b_ranks) == 1 and a_ranks | b_ranks == ranks  # one rank on each node
    assert "run on every other node" in caplog.text and node_b.spec in caplog.text  # the command for node B
    assert two.extra["metrics"]["steps"] == 4
    _assert_same_weights(cluster["one"], _weights(cluster["store"], "fp-two"))
    store = cluster["store"]
    for name in ("export/vllm/config.json", "export/speculators/config.json"):  # exported from rank 0's files
        assert store.fs.cat_file(store.stage_path("train", "fp-two", name)) == store.fs.cat_file(
            store.stage_path("train", "fp-one", name)
        )
    assert not [f for f in (node_b.cache / "train-work").rglob("*") if f.is_file()]  # node B cleaned up its own
    read = [f for f in node_b.cache.rglob("*") if f.is_file() and "train-work" not in f.parts]
    assert read, "node B read its features from S3 into its own cache (whole shards or ranges, either way)"
    assert not store.fs.exists(store.stage_path("train", "fp-two", "work"))  # launch folder and checkpoints gone


def test_a_node_killed_mid_run_resumes_from_the_store_to_the_same_weights(cluster, tiny_target, caplog):
    store, tmp = cluster["store"], cluster["tmp"].mktemp("node-b-killed")
    step2 = store.stage_path("train", "fp-kill", "work", "checkpoints", "step_00000002", "COMPLETE")
    node_b = NodeB(tmp, "fp-kill", module="tests.multinode_node", DRAFTFLOW_TEST_HANG_AT_STEP="3")
    node_b.start()
    failed: list[BaseException] = []

    def node_a() -> None:
        try:
            _train(tiny_target, cluster["features"], "fp-kill", *_two_nodes(node_b))
        except BaseException as exc:  # noqa: BLE001  (inspected below)
            failed.append(exc)

    a = threading.Thread(target=node_a, daemon=True)
    a.start()
    deadline = time.monotonic() + DEADLINE_S
    while not store.fs.exists(step2):  # the step-2 checkpoint is in the store; node B hangs in step 3
        assert a.is_alive() and node_b.proc.poll() is None and time.monotonic() < deadline, node_b.output()[-3000:]
        time.sleep(0.2)
        store.fs.invalidate_cache()
    node_b.kill()
    a.join(DEADLINE_S)
    assert not a.is_alive() and len(failed) == 1 and isinstance(failed[0], TrainingCrashed), failed
    assert store.read_manifest("train", "fp-kill") is None

    # Both nodes start again (node B as before, without the hang): both resume from the store's step 2.
    node_b = NodeB(tmp, "fp-kill")
    node_b.start()
    with caplog.at_level(logging.INFO, logger="draftflow.training.launch"):
        again = _train(tiny_target, cluster["features"], "fp-kill", *_two_nodes(node_b))
    assert node_b.wait() == 0, node_b.output()[-3000:]
    assert "at step 2 of 4" in caplog.text and "at step 2 of 4" in node_b.output()  # "resumed from ... at step 2"
    assert again.extra["metrics"]["steps"] == 4
    # Node B held a step-2 checkpoint in its work folder (written as rank 0, or pulled): gone once the run is done.
    assert not [f for f in (tmp / "cache" / "train-work").rglob("*") if f.is_file()]
    _assert_same_weights(cluster["one"], _weights(store, "fp-kill"))
