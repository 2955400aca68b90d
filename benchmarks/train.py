"""Training-step speed of a DFlash drafter: tokens/s, step time and (on CUDA) MFU.

Runs `train_drafter`'s inner step (anchors, blocks, forward, decayed loss, backward,
clip, AdamW) on random features for a configurable drafter shape. Default: tiny, CPU
seconds. `--qwen3-8b`: the paper's shape (5 layers, D 4096, B 16, 512 anchors, seq
3072), for one GPU:  python -m benchmarks.train --qwen3-8b --steps 10

It prints the step's achieved FLOP/s against a dense matmul measured on the same
device in the same run (the baseline), and on CUDA the MFU against the peak.
MFU counts matmul FLOPs of the trainable drafter plus the frozen LM head
(6 * params * tokens for trained weights, 4 * for the head, which needs input grads
only) and attention (QK^T and PV over the keys each query may see), against the
GPU's dense bf16 peak (`--peak-tflops`, default 989 for H100/H200 SXM).
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from draftflow.config import DrafterConfig, TrainConfig
from draftflow.drafters.batches import total_steps
from draftflow.drafters.dflash.config import DFlashConfig
from draftflow.drafters.dflash.model import DFlashDrafter
from draftflow.drafters.dflash.objective import DFlashObjective
from draftflow.features import FeatureSample
from draftflow.training.distributed import DistEnv
from draftflow.training.loop import _Run, _train_step
from draftflow.training.schedule import warmup_cosine

TINY = dict(hidden=64, inter=128, heads=4, kv=2, vocab=320, layers=1, block=4, anchors=16, seq=128)
QWEN3_8B = dict(hidden=4096, inter=12288, heads=32, kv=8, vocab=151936, layers=5, block=16, anchors=512, seq=3072)


class _Target(torch.nn.Module):
    """Stand-in target: just the embedding and LM head the drafter borrows."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(vocab, hidden), torch.nn.Linear(hidden, vocab, bias=False)

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head


def build(shape: dict, device: torch.device, backend: str) -> tuple[_Run, list[FeatureSample]]:
    tc = SimpleNamespace(num_hidden_layers=36, hidden_size=shape["hidden"], num_attention_heads=shape["heads"],
                         num_key_value_heads=shape["kv"], head_dim=128 if shape["hidden"] > 64 else 16,
                         intermediate_size=shape["inter"], rms_norm_eps=1e-6, rope_theta=1e6,
                         vocab_size=shape["vocab"], rope_scaling=None)
    dcfg = DFlashConfig.from_target(tc, DrafterConfig(num_layers=shape["layers"], block_size=shape["block"],
                                                      attn_backend=backend), shape["vocab"] - 1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    drafter = DFlashDrafter(dcfg, _Target(shape["vocab"], shape["hidden"])).to(device, dtype)
    tcfg = TrainConfig(num_anchors=shape["anchors"], device=str(device))
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tcfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(1, 100))
    T = shape["seq"]
    samples = [FeatureSample("b", torch.randint(0, shape["vocab"] - 1, (T,)), torch.ones(T, dtype=torch.bool),
                             torch.randn(T, 5, shape["hidden"], dtype=dtype))]
    run = _Run(drafter, opt, sched, samples, tcfg, DFlashObjective(dcfg, tcfg), total_steps(1, tcfg), "",
               {}, device, DistEnv(), None)
    return run, samples


def step_flops(run: _Run, shape: dict) -> float:
    trainable, _ = run.drafter.param_counts()
    q, T = shape["anchors"] * shape["block"], shape["seq"]
    head = shape["hidden"] * shape["vocab"]
    ctx_flops = 6 * run.drafter.fc.weight.numel() * T  # fc over every context position
    per_q_keys = T / 2 + shape["block"]  # anchors spread uniformly: half the context on average
    attn = 3 * 4 * q * per_q_keys * shape["heads"] * run.drafter.config.head_dim * shape["layers"]
    return 6 * (trainable - run.drafter.fc.weight.numel()) * q + ctx_flops + 4 * head * q + attn


def matmul_flops_per_s(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 5) -> float:
    """The device's dense matmul throughput, measured now: the same-run baseline."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync()
    return 2 * n**3 * repeats / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qwen3-8b", action="store_true", help="the paper's Qwen3-8B drafter shape")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--backend", default="auto", choices=["auto", "sdpa", "flex"])
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    args = ap.parse_args()
    shape = QWEN3_8B if args.qwen3_8b else TINY
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run, samples = build(shape, device, args.backend)
    _train_step(run, list(enumerate(samples)), 0)  # warm-up (compilation)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for s in range(args.steps):
        _train_step(run, list(enumerate(samples)), s + 1)
    sync()
    dt = (time.perf_counter() - t0) / args.steps
    tokens = shape["anchors"] * shape["block"]
    print(f"shape={'qwen3-8b' if args.qwen3_8b else 'tiny'} device={device} step={dt * 1e3:.1f} ms "
          f"block tokens/s={tokens / dt:,.0f} context tokens/s={shape['seq'] / dt:,.0f}")
    achieved = step_flops(run, shape) / dt
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base = matmul_flops_per_s(device, dtype, 8192 if device.type == "cuda" else 1024)
    print(f"achieved {achieved / 1e12:.3f} TFLOP/s  dense matmul baseline {base / 1e12:.3f} TFLOP/s  "
          f"ratio {achieved / base:.2f}")
    if device.type == "cuda":
        print(f"MFU={achieved / (args.peak_tflops * 1e12):.1%} (peak {args.peak_tflops} TFLOPS)")


if __name__ == "__main__":
    main()
