"""Data-parallel training under torchrun: process group, rank shares, gradient sync, launcher.

Each rank takes `indices[rank::world_size]` of a step's global batch; after the local
gradient accumulation, gradients are summed across ranks (what DDP's reducer does, done
once per optimizer step so ranks may hold different numbers of micro-batches, e.g. when
a sequence has no anchor). Every rank then clips and steps identically; rank 0 alone
writes checkpoints and the final drafter.

What it does not know: the model, the loss or the data. FSDP2 is not wired yet: a
drafter (~1B parameters for Qwen3-8B) fits on one GPU, so replication is the default.

Key trade-off: one all-reduce per parameter per step, after backward, instead of DDP's
bucketed overlap with backward; simple and exact, slower for large drafters on many GPUs.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from draftflow.config import TrainConfig
from draftflow.errors import ConfigError


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def share(self, items: list) -> list:
        """This rank's part of a global batch (strided, so shares differ by at most one)."""
        return items[self.rank :: self.world_size]


def init_distributed(device: torch.device) -> DistEnv:
    """Join the process group torchrun describes (WORLD_SIZE > 1); else a 1-process env.

    nccl on CUDA, gloo on CPU. An already initialised group (tests, notebooks) is reused.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 and not dist.is_initialized():
        return DistEnv()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return DistEnv(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def all_reduce_sum(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum a tensor over ranks in place (no-op on one process)."""
    if env.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def sync_gradients(params: list[torch.nn.Parameter], env: DistEnv) -> None:
    """Sum gradients over ranks; a rank without a gradient contributes zeros."""
    if env.world_size == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


def torchrun_command(tcfg: TrainConfig, module: str, args: list[str]) -> list[str]:
    """The torchrun command line that runs `python -m module args` on this node.

    Multi-node runs need `train.rdzv_endpoint` (host:port reachable from every node);
    each node runs the same command (c10d rendezvous assigns ranks).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={tcfg.nproc_per_node}",
           f"--nnodes={tcfg.nnodes}"]
    if tcfg.rdzv_endpoint:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={tcfg.rdzv_endpoint}"]
    elif tcfg.nnodes > 1:
        raise ConfigError("train.nnodes > 1 needs train.rdzv_endpoint (host:port of the rendezvous)")
    else:
        cmd.append("--standalone")
    return [*cmd, "-m", module, *args]
