"""The learning-rate schedule training steps by (warmup, then cosine decay to zero)."""

from __future__ import annotations

import math


def warmup_cosine(warmup_steps: int, total_steps: int):
    """LR multiplier: linear warmup to 1, then cosine decay to 0 at `total_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor
