"""Data-parallel training under torchrun: process group, rank shares, gradient sync, FSDP2, launcher.

Each rank takes `indices[rank::world_size]` of a step's global batch and accumulates its
gradients one sequence per forward; the step's loss is normalised by the *global* label
weight, so summing gradients over ranks gives exactly the 1-process gradient.

Two ways to sum them (`train.parallel`):

* `ddp` (default): every rank holds the whole drafter; after the local accumulation each
  gradient is all-reduced once per optimizer step (`sync_gradients`). This is what torch's
  `DistributedDataParallel` computes, without its wrapper: DDP's reducer needs the same
  number of backward passes on every rank (or `no_sync` bookkeeping) and averages, while here
  a rank may hold fewer sequences (strided shares, sequences without an anchor) and the sum
  is exact. Cost: no overlap of communication with backward (bucketed overlap matters for
  large drafters on many GPUs; a DFlash drafter is ~1B parameters for an 8B target).
* `fsdp`: FSDP2 (`fully_shard`, DTensor) shards each decoder layer and the remaining
  trainable weights over ranks, so parameters, gradients and AdamW state take 1/world of
  the memory. The target's frozen embedding and LM head are left out (`ignored_params`):
  replicated, never in the optimizer. FSDP issues collectives in every forward and backward,
  so every rank runs exactly ceil(batch_size / world) passes per step: its micro-batches,
  then zero-weight passes re-running its last inputs (a rank may hold one sequence fewer,
  or a sequence without an anchor). Gradients accumulate unsharded and are reduce-scattered
  (summed) once, in the backward of the step's last pass.

What it does not know: the model's inputs, the loss or the data. Also here: bf16 autocast of
the forward on CUDA (`prepare_model`), and the torchrun command line.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from draftflow.config import TrainConfig
from draftflow.errors import ConfigError, DraftflowError


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def local_world(self) -> int:
        """Ranks of this run on this machine (torchrun's LOCAL_WORLD_SIZE; all of them when it is unset)."""
        if self.world_size <= 1:
            return 1
        return int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def share(self, items: list) -> list:
        """This rank's part of a global batch (strided, so shares differ by at most one)."""
        return items[self.rank :: self.world_size]


def init_distributed(device: torch.device, timeout_s: float | None = None) -> DistEnv:
    """Join the process group torchrun describes (WORLD_SIZE > 1); else a 1-process env.

    nccl on CUDA, gloo on CPU. An already initialised group (tests, notebooks) is reused.
    `timeout_s` (`train.collective_timeout_s`) bounds every collective: a peer lost without a
    closed connection (a partitioned link) fails the rank then, not after torch's 30 min default.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 and not dist.is_initialized():
        return DistEnv()
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    return DistEnv(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def all_reduce_sum(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum a tensor over ranks in place (no-op on one process)."""
    if env.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(value: int, env: DistEnv) -> int:
    """The largest `value` over ranks (identity on one process)."""
    if env.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


# ----------------------------------------------------------------------------- model preparation


def is_fsdp(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def prepare_model(model: torch.nn.Module, tcfg: TrainConfig, env: DistEnv, device: torch.device) -> torch.nn.Module:
    """Shard with FSDP2 (`train.parallel=fsdp`, more than one process) and autocast on CUDA (`train.bf16`).

    Call before building the optimizer: sharding replaces the parameters by DTensors.
    """
    if tcfg.parallel == "fsdp" and env.world_size > 1:
        if tcfg.batch_size < env.world_size:
            raise ConfigError(f"train.parallel=fsdp on {env.world_size} processes needs train.batch_size >= "
                              f"{env.world_size} (it is {tcfg.batch_size}): every rank must hold a sequence")
        shard_model(model, passes_per_step=math.ceil(tcfg.batch_size / env.world_size))
    if device.type == "cuda" and tcfg.bf16:
        # Matmuls in bf16, weights and optimizer in fp32; the losses cast logits to fp32.
        model.forward = torch.autocast("cuda", dtype=torch.bfloat16)(model.forward)
    return model


def adamw(params: list[torch.nn.Parameter], tcfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over `params`, by torch's fused kernel where every one is a plain tensor on a CPU or CUDA device (not an
    FSDP shard): the same update in one pass over each tensor. On a 2-core CPU, for EAGLE-3's 9.8 M trainable
    parameters, 5.6 ms a step against 28.5 ms by torch's default there (one tensor at a time, several passes): ~10%
    of a SmolLM2 training step (docs/measurements.md, 2026-12-08)."""
    fused = all(type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, lr=tcfg.lr, weight_decay=tcfg.weight_decay, fused=fused or None)


def shard_model(model: torch.nn.Module, passes_per_step: int) -> None:
    """FSDP2: one unit per decoder layer (`model.layers`), one for the rest; frozen params stay whole.

    Every rank then runs exactly `passes_per_step` forward passes per optimizer step (its
    micro-batches, then zero-weight passes); the last one reduce-scatters the gradients.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    frozen = {p for p in model.parameters() if not p.requires_grad}  # the target's embedding / LM head
    for layer in getattr(model, "layers", []):
        fully_shard(layer)
    fully_shard(model, ignored_params=frozen)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # sum, not mean: the loss is normalised by the global weight
            m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has neither AVG nor PREMUL_SUM)
    model.set_requires_gradient_sync(False)  # accumulate locally until the step's last pass
    model._draftflow_step = _FsdpStep(passes_per_step)
    model.register_forward_pre_hook(_count_pass, with_kwargs=True)


@dataclass
class _FsdpStep:
    """Per-step bookkeeping of an FSDP model: passes so far, the inputs of the last one."""

    passes_per_step: int
    passes: int = 0
    last_inputs: Any = None


def _count_pass(module, args, kwargs) -> None:
    st = module._draftflow_step
    st.passes += 1
    st.last_inputs = (args, kwargs)  # re-run by zero-weight padding passes
    if st.passes == st.passes_per_step:  # the step's last pass: its backward reduce-scatters
        module.set_requires_gradient_sync(True)


@contextmanager
def uncounted_passes(model: torch.nn.Module) -> Iterator[None]:
    """Forward passes that are not a training step's (held-out measurement): under FSDP the step's pass count,
    its last inputs and the gradient-sync switch are put back after them, so the next step pads as it should."""
    st = getattr(model, "_draftflow_step", None)
    saved = None if st is None else (st.passes, st.last_inputs)
    try:
        yield
    finally:
        if st is not None:
            st.passes, st.last_inputs = saved
            model.set_requires_gradient_sync(st.passes == st.passes_per_step)


# ----------------------------------------------------------------------------- gradients


def sync_gradients(params: list[torch.nn.Parameter], env: DistEnv, model: torch.nn.Module | None = None,
                   backward: bool = True) -> None:
    """Sum this step's gradients over ranks; call once after the step's micro-batches.

    Args:
        params: the trainable parameters.
        env: the process group's view.
        model: the (possibly FSDP-sharded) model; needed under FSDP only.
        backward: whether the step ran backward passes (false when the global step had no labels).
    """
    if env.world_size == 1:
        return
    if model is not None and is_fsdp(model):
        _fsdp_finish_step(model, env, backward)
        return
    if not backward:
        return
    for p in params:
        if p.grad is None:  # a rank without a gradient contributes zeros
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


def _fsdp_finish_step(model, env: DistEnv, backward: bool) -> None:
    """Pad this rank to the step's pass count with zero-weight passes (no collective before them:
    another rank may still be inside its own passes, whose collectives these must match)."""
    st = model._draftflow_step
    if st.passes < st.passes_per_step and st.last_inputs is None:
        raise DraftflowError(
            f"train.parallel=fsdp: rank {env.rank} had no sequence with a trainable position in its first step, "
            "so it cannot pad its passes; use train.parallel=ddp or filter out sequences without supervised tokens"
        )
    while st.passes < st.passes_per_step:
        _zero_pass(model, st.last_inputs, backward)
    assert st.passes == st.passes_per_step, (st.passes, st.passes_per_step)
    st.passes = 0
    model.set_requires_gradient_sync(False)


def _zero_pass(model, inputs, backward: bool) -> None:
    """A forward (and backward) whose loss is 0: issues FSDP's collectives, adds no gradient."""
    args, kwargs = inputs
    out = model(*args, **kwargs)
    if backward:
        leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        (sum(t.float().sum() for t in leaves) * 0.0).backward()


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the total gradient norm (over every shard under FSDP); return the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


# ----------------------------------------------------------------------------- launcher


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
