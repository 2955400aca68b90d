"""Linear layers that stay fast when a forward pass carries only a few rows (speculative verify and drafting on CPU).

Speculative decoding feeds the target a handful of positions per step ([anchor, drafts]: 2-8 rows) and a
block drafter as many. On torch's CPU build `F.linear(x, W)` with 2-7 rows of x runs one matrix-vector
product per row, so reading W costs that many times: measured on the 2-core development VM (torch 2.13,
AVX-512, no AMX, float32), SmolLM2-135M's 49,152 x 576 LM head took 10 ms for 1 row, 24 ms for 2 and 38
ms for 3, but 4.6 ms as `W @ x.T` for 2 or 3 rows; a whole SmolLM2 forward of 3 positions with a KV cache
went from ~115 ms to ~60 ms, of 1 position unchanged (`benchmarks/small_rows.py` prints both).

Every target loaded on the CPU has it (`draftflow.target.load_target`), whichever stage loads it first, so a
stage's numbers never depend on what ran before it in the process; evaluate swaps its loaded drafters too.

What it does not know: which model it is in (it swaps the class of every `nn.Linear` below a module), GPUs
(CUDA's kernels handle few rows well: it changes nothing off the CPU), training (many rows: the plain path).

Key trade-off: the transposed product sums in another order, so a swapped layer's output equals the plain
one only up to float rounding, as a cached forward already differs from an uncached one
(`draftflow.evaluation.cached`): a verify step of 2-7 positions and the lossless check's one forward over the
whole output (plain path) agree up to rounding, so a near-tie argmax could still flip (never seen in fp32).
"""

from __future__ import annotations

import torch
from torch import nn

# Row counts that take the transposed product. 1 row is already one fast matrix-vector product, and from 8 rows
# torch's own matrix-matrix kernel is at least as fast (measured as above: 8 rows 84-114 ms either way).
FEW_ROWS = range(2, 8)
# Only weights of at least this many elements (1 MiB in float32) are swapped: a smaller one stays in the core's
# cache, where reading it once per row is cheap and the plain layer was faster (the tiny demo target's 64-wide
# layers at 1 thread: 7 us against 18 us), while SmolLM2's whole forward of 2-3 positions, read from memory,
# ran ~1.5-2x faster with every layer of 1 MiB or more swapped, at 1 thread as at 2.
MIN_WEIGHT = 1 << 18


class SmallRowsLinear(nn.Linear):
    """`nn.Linear` computing `(W @ x.T).T` when x has 2-7 rows on the CPU; the same weights and state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if x.device.type != "cpu" or rows not in FEW_ROWS:
            return super().forward(x)
        y = (self.weight @ x.reshape(rows, -1).t()).t().contiguous()  # (out, in) @ (in, rows) -> (rows, out)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def use_small_rows(module: nn.Module, min_weight: int = MIN_WEIGHT) -> nn.Module:
    """Swap every plain `nn.Linear` below `module` (itself included) whose weight has at least `min_weight`
    elements for `SmallRowsLinear`, in place.

    Only exact `nn.Linear` instances change (a subclass keeps its own forward). Idempotent.

    Returns:
        module, for chaining.
    """
    for sub in module.modules():
        if type(sub) is nn.Linear and sub.weight.numel() >= min_weight:
            sub.__class__ = SmallRowsLinear
    return module
