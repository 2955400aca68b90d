"""Two training nodes on a real network: a node lost and a link cut mid-training, then a clean re-run.

Each "host" is a Linux network namespace with its own address (10.213.0.1, 10.213.0.2), joined by a
veth pair: the c10d rendezvous and gloo's traffic cross a real link, which the test cuts (`ip link
set down`: packets vanish, no connection is reset, as when a switch port or a route dies) and whose
far end it kills (every process in the namespace: a node lost). The run root is a local folder both
hosts see, as a shared filesystem (NFS) on a real cluster. Node B hosts the rendezvous and runs the
command the train stage logs for the other nodes; node A runs the train stage (tests/reliability/netnode.py).

1. Link cut while both ranks are in step 3's collectives: each rank fails after
   `train.collective_timeout_s`, and node A's torchrun agent, which then waits on the rendezvous store
   behind the cut link for minutes, is ended `DRAFTFLOW_AGENT_GRACE_S` later: one line, no process left.
2. Node B killed in step 5: node A fails in one line (its peer's connections close), nothing left.
3. Link back, both nodes started again: they resume at step 4 and end with the weights of a one-node
   run with the same global batch (test_multinode's comparison), so neither fault trained on anything
   wrong or lost a step.

Needs root and `ip` (netns, veth); skipped otherwise. Nodes know their address on the link from
torchrun's `PET_LOCAL_ADDR` and gloo's `GLOO_SOCKET_IFNAME` (docs/operations.md): this host's name
resolves to 127.0.0.1, which is no address of the other node. About 2.5 min on 2 cores.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from draftflow.config import TrainConfig
from draftflow.stages import train as train_stage
from draftflow.store import Store
from draftflow.training.distributed import torchrun_command
from tests.conftest import one_shard_features, stamped, tiny_config
from tests.reliability.netns import ADDR, Hosts, two_hosts, wait_listening
from tests.test_multinode import _assert_same_weights, _weights

TRAIN = ["train.max_steps=6", "train.batch_size=3", "train.checkpoint_every=2", "train.num_anchors=8"]
COLLECTIVE_S = 20  # train.collective_timeout_s of the two-node runs
GRACE_S = 15  # node A's DRAFTFLOW_AGENT_GRACE_S (60 by default): a torchrun agent left waiting is ended then
DEADLINE_S = 600  # a node that has not ended by then hangs: generous for a loaded 2-core machine
pytestmark = pytest.mark.reliability


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_target):
    """A local root with one train shard's features, and a one-node run's weights (in this process)."""
    root = tmp_path_factory.mktemp("netns") / "run"
    cfg = tiny_config(root, *TRAIN)
    store, features = one_shard_features(cfg, tiny_target)
    one = train_stage.run(store, stamped("train", "fp-one", {"extract": "d"}), cfg, tiny_target, features)
    assert one.extra["metrics"]["steps"] == 6
    (root.parent / "features.json").write_text(json.dumps(features.model_dump(mode="json")))
    return {"root": root, "features": root.parent / "features.json", "one": _weights(store, "fp-one")}


class Run:
    """One two-node launch of the train stage: node B (rendezvous host) first, then node A."""

    def __init__(self, hosts: Hosts, prepared: dict, port: int, name: str, **b_env: str):
        self.hosts, self.logs = hosts, {h: prepared["root"].parent / f"{name}-{h}.log" for h in ADDR}
        endpoint = f"{ADDR['b']}:{port}"
        spec = str(Path(train_stage.work_dir(Store(str(prepared["root"])), "fp-net")) / "launch" / "spec.json")
        module = "tests.multinode_node" if b_env else "draftflow.training.launch"
        cmd = torchrun_command(TrainConfig(nnodes=2, rdzv_endpoint=endpoint), module, [spec])
        cmd.insert(cmd.index("-m", 3), "--rdzv-conf=is_host=1")
        self.b = hosts.start("b", cmd, self.logs["b"], DRAFTFLOW_CACHE=str(prepared["root"].parent / "cache-b"),
                             **b_env)
        wait_listening(self.b, port)
        overrides = [*TRAIN, "train.nnodes=2", f"train.rdzv_endpoint={endpoint}",
                     f"train.collective_timeout_s={COLLECTIVE_S}"]
        self.a = hosts.start("a", [sys.executable, "-m", "tests.reliability.netnode", str(prepared["root"]), "fp-net",
                                   str(prepared["features"]), *overrides], self.logs["a"],
                             DRAFTFLOW_CACHE=str(prepared["root"].parent / "cache-a"),
                             DRAFTFLOW_AGENT_GRACE_S=str(GRACE_S))

    def wait_for_checkpoint(self, root: Path, step: int) -> None:
        done = Path(train_stage.work_dir(Store(str(root)), "fp-net")) / "checkpoints" / f"step_{step:08d}"
        deadline = time.monotonic() + DEADLINE_S
        while not (done / "checksums.json").exists():  # written last: the checkpoint is complete
            assert self.a.poll() is None and self.b.poll() is None, self.output()
            assert time.monotonic() < deadline, self.output()
            time.sleep(0.2)

    def end_of_a(self) -> tuple[int, str, float]:
        """Node A's exit code, last line, and seconds it took to end from now."""
        t0 = time.monotonic()
        rc = self.a.wait(timeout=DEADLINE_S)
        last = self.logs["a"].read_text().strip().splitlines()[-1]
        return rc, last, time.monotonic() - t0

    def output(self) -> str:
        return "\n".join(f"--- node {h}:\n{log.read_text()[-3000:]}" for h, log in self.logs.items())


def test_a_cut_link_and_a_lost_node_end_in_one_line_and_the_rerun_resumes_to_the_same_weights(prepared):
    root = prepared["root"]
    with two_hosts() as hosts:
        # 1. The link is cut while both ranks are about to exchange step 3's gradients.
        go = root.parent / "go"
        run = Run(hosts, prepared, 29401, "cut", DRAFTFLOW_TEST_HANG_AT_STEP="3", DRAFTFLOW_TEST_HOLD_UNTIL=str(go))
        run.wait_for_checkpoint(root, 2)
        hosts.link(up=False)
        go.touch()
        rc, last, took = run.end_of_a()
        assert rc == 1 and last.startswith("draftflow: error: training under torchrun failed"), run.output()
        assert took < COLLECTIVE_S + GRACE_S + 120, (took, run.output())  # not torchrun's minutes
        assert hosts.pids("a") == [], "node A's run left processes behind"
        hosts.kill("b")
        hosts.link(up=True)
        assert not (Path(train_stage.work_dir(Store(str(root)), "fp-net")) / "checkpoints" / "step_00000004").exists()

        # 2. Node B is lost in step 5 (after the step-4 checkpoint; resumed at 2, so its third step).
        run = Run(hosts, prepared, 29402, "lost", DRAFTFLOW_TEST_HANG_AT_STEP="3")
        run.wait_for_checkpoint(root, 4)
        assert "at step 2 of 6" in run.output()  # both resumed from the checkpoint the cut left
        hosts.kill("b")
        rc, last, _ = run.end_of_a()
        assert rc == 1 and last.startswith("draftflow: error: training under torchrun failed"), run.output()
        assert hosts.pids("a") == [], "node A's run left processes behind"
        assert Store(str(root)).read_manifest("train", "fp-net") is None  # nothing looks complete

        # 3. Both nodes again: resumed at step 4, the weights of the one-node run.
        run = Run(hosts, prepared, 29403, "clean")
        rc, last, _ = run.end_of_a()
        assert rc == 0 and last == "trained 6 steps", run.output()
        assert run.b.wait(timeout=DEADLINE_S) == 0, run.output()
        assert "at step 4 of 6" in run.output()
    _assert_same_weights(prepared["one"], _weights(Store(str(root)), "fp-net"))
