"""Data-parallel training on CPU: 2 gloo processes (DDP-style or FSDP2) equal 1 process with the same global batch."""

from __future__ import annotations

import json
import os
import shutil
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

import draftflow.training.loop as train_mod
from draftflow.config import DrafterConfig, TrainConfig
from draftflow.drafters.dflash.config import DFlashConfig
from draftflow.errors import ConfigError
from draftflow.features import FeatureSample
from draftflow.training.distributed import DistEnv, torchrun_command
from draftflow.training.loop import train_drafter
from tests.conftest import MASK_ID


def _cfgs(target, **train):
    dcfg = DFlashConfig.from_target(target.config, DrafterConfig(num_layers=1, block_size=4, num_taps=3), MASK_ID)
    tcfg = TrainConfig(**(dict(epochs=10, max_steps=6, batch_size=4, lr=3e-3, num_anchors=6, checkpoint_every=3,
                                device="cpu", seed=0, nproc_per_node=2) | train))
    return dcfg, tcfg


def _samples(short: bool = False):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(8):  # mixed lengths: buckets and uneven anchor counts across ranks
        T = 16 + 2 * i
        mask = torch.arange(T) >= 3
        out.append(FeatureSample(f"s{i}", torch.randint(0, MASK_ID, (T,), generator=g), mask,
                                 torch.randn(T, 3, 64, generator=g)))
    if short:  # T = B: no anchor fits, so the rank holding it runs one forward fewer
        out.append(FeatureSample("short", torch.arange(4), torch.ones(4, dtype=torch.bool), torch.randn(4, 3, 64)))
    return out


def _counting_steps() -> list:
    """Count optimizer steps this process runs (a resumed run runs only the remaining ones)."""
    real, calls = train_mod._train_step, []

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    train_mod._train_step = counted
    return calls


def _worker(rank: int, world: int, store: str, target, runs: list[tuple[str, dict, bool]]) -> None:
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank))
    torch.set_num_threads(1)
    # A file rendezvous: a free TCP port picked beforehand can be taken by another process before the
    # ranks bind it (seen on a loaded machine as a gloo abort).
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    calls = _counting_steps()
    try:
        for out_dir, train, short in runs:
            dcfg, tcfg = _cfgs(target, **train)
            calls.clear()
            metrics = train_drafter(_samples(short), target, dcfg, tcfg, out_dir)
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                json.dump(metrics | {"steps_run": len(calls)}, f)
        # As the torchrun ranks do (`training.launch._barrier`): no rank tears its process group down while
        # the other still works in it (seen on a loaded machine as a gloo abort in FSDP's teardown).
        dist.barrier()
    except BaseException:
        # The cause, printed before anything else: tearing the group down while the peer is still in a collective
        # can abort this process (SIGABRT, "terminate called without an active exception", seen once in CI under
        # load) before spawn records the exception. So a failing rank leaves its group to process exit.
        traceback.print_exc()
        raise
    dist.destroy_process_group()


def _rendezvous(tmp_path) -> str:
    """A fresh rendezvous file for one process group."""
    import uuid

    return str(tmp_path / f"rendezvous-{uuid.uuid4().hex}")


def test_two_gloo_ranks_equal_one_process(tmp_path, target):
    dcfg, tcfg = _cfgs(target)
    single = train_drafter(_samples(), target, dcfg, tcfg, str(tmp_path / "one"))
    runs = [(str(tmp_path / "two"), {}, False)]
    mp.spawn(_worker, args=(2, _rendezvous(tmp_path), target, runs), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / "two" / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]  # every rank sees the global metrics
    assert ranks[0]["loss"] == pytest.approx(single["loss"], rel=1e-5)
    assert ranks[0]["accuracy"] == pytest.approx(single["accuracy"])
    one = load_file(str(tmp_path / "one" / "model.safetensors"))
    two = load_file(str(tmp_path / "two" / "model.safetensors"))
    for k in one:
        torch.testing.assert_close(two[k], one[k], atol=1e-5, rtol=1e-4)
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == ["step_00000003", "step_00000006"]


def test_rank_share_is_strided():
    assert DistEnv(1, 3).share(list(range(8))) == [1, 4, 7]
    assert DistEnv().share([5, 6]) == [5, 6]


def test_torchrun_command_from_config():
    cmd = torchrun_command(TrainConfig(nproc_per_node=8), "draftflow.cli", ["train"])
    assert cmd[1:] == ["-m", "torch.distributed.run", "--nproc-per-node=8", "--nnodes=1", "--standalone",
                       "-m", "draftflow.cli", "train"]
    multi = torchrun_command(TrainConfig(nproc_per_node=8, nnodes=2, rdzv_endpoint="head:29400"), "m", [])
    assert "--rdzv-endpoint=head:29400" in multi and "--rdzv-backend=c10d" in multi and "--nnodes=2" in multi
    with pytest.raises(ConfigError, match="rdzv_endpoint"):
        torchrun_command(TrainConfig(nnodes=2), "m", [])


def _weights(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def _assert_same_weights(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, k
        torch.testing.assert_close(b[k], a[k], atol=2e-5, rtol=1e-4)


def _step3_copy(src, dst) -> None:
    """A copy of a finished run folder holding only its step-3 checkpoint (as if it died at step 4)."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / "step_00000006")
    for f in ("model.safetensors", "config.json", "metrics.json", "rank0.json", "rank1.json"):
        (dst / f).unlink(missing_ok=True)


def test_fsdp_equals_one_process_and_checkpoints_resume_across_modes(tmp_path, target, monkeypatch):
    # 3 sequences a step over 2 ranks plus one without an anchor: ranks run unequal forward counts.
    fsdp = {"parallel": "fsdp", "batch_size": 3}
    dcfg, tcfg = _cfgs(target, **fsdp)
    single = train_drafter(_samples(short=True), target, dcfg, tcfg, str(tmp_path / "one"))
    assert single["skipped_sequences"] > 0
    _step3_copy(tmp_path / "one", tmp_path / "one_then_fsdp")
    runs = [(str(tmp_path / "fsdp"), fsdp, True), (str(tmp_path / "one_then_fsdp"), fsdp, True)]
    mp.spawn(_worker, args=(2, _rendezvous(tmp_path), target, runs), nprocs=2, join=True)

    ranks = [json.loads((tmp_path / "fsdp" / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1] and ranks[0]["steps_run"] == 6
    assert ranks[0]["loss"] == pytest.approx(single["loss"], rel=1e-4)
    assert ranks[0]["accuracy"] == pytest.approx(single["accuracy"])
    assert ranks[0]["trainable_params"] == single["trainable_params"]  # DTensor counts are global
    _assert_same_weights(_weights(tmp_path / "one"), _weights(tmp_path / "fsdp"))
    # The checkpoint holds the full weights, in the same format as a 1-process one.
    _assert_same_weights(_weights(tmp_path / "one" / "checkpoints" / "step_00000003"),
                         _weights(tmp_path / "fsdp" / "checkpoints" / "step_00000003"))

    # A 1-process checkpoint resumed by 2 FSDP ranks ...
    resumed = json.loads((tmp_path / "one_then_fsdp" / "rank0.json").read_text())
    assert resumed["steps_run"] == 3 and resumed["loss"] == pytest.approx(single["loss"], rel=1e-4)
    _assert_same_weights(_weights(tmp_path / "one"), _weights(tmp_path / "one_then_fsdp"))
    # ... and an FSDP checkpoint resumed by 1 process (DDP mode; the same on 2 DDP ranks).
    _step3_copy(tmp_path / "fsdp", tmp_path / "fsdp_then_one")
    monkeypatch.setattr(train_mod, "_train_step", train_mod._train_step)  # restores the real one afterwards
    calls = _counting_steps()
    back = train_drafter(_samples(short=True), target, dcfg, tcfg.model_copy(update={"parallel": "ddp"}),
                         str(tmp_path / "fsdp_then_one"))
    assert len(calls) == 3 and back["loss"] == pytest.approx(single["loss"], rel=1e-4)
    _assert_same_weights(_weights(tmp_path / "one"), _weights(tmp_path / "fsdp_then_one"))
