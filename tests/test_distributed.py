"""Data-parallel training on CPU: 2 gloo processes equal 1 process with the same global batch."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from draftflow.config import DrafterConfig, TrainConfig
from draftflow.distributed import DistEnv, torchrun_command
from draftflow.errors import ConfigError
from draftflow.features import FeatureSample
from draftflow.models.dflash import DFlashConfig
from draftflow.train import train_drafter
from tests.conftest import MASK_ID


def _cfgs(target):
    dcfg = DFlashConfig.from_target(target.config, DrafterConfig(num_layers=1, block_size=4, num_taps=3), MASK_ID)
    tcfg = TrainConfig(epochs=10, max_steps=6, batch_size=4, lr=3e-3, num_anchors=6, checkpoint_every=3,
                       device="cpu", seed=0, nproc_per_node=2)
    return dcfg, tcfg


def _samples():
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(8):  # mixed lengths: buckets and uneven anchor counts across ranks
        T = 16 + 2 * i
        mask = torch.arange(T) >= 3
        out.append(FeatureSample(f"s{i}", torch.randint(0, MASK_ID, (T,), generator=g), mask,
                                 torch.randn(T, 3, 64, generator=g)))
    return out


def _worker(rank: int, world: int, port: int, target, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        dcfg, tcfg = _cfgs(target)
        metrics = train_drafter(_samples(), target, dcfg, tcfg, out_dir)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(metrics, f)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_ranks_equal_one_process(tmp_path, target):
    dcfg, tcfg = _cfgs(target)
    single = train_drafter(_samples(), target, dcfg, tcfg, str(tmp_path / "one"))
    mp.spawn(_worker, args=(2, _free_port(), target, str(tmp_path / "two")), nprocs=2, join=True)
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
