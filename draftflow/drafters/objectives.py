"""What every kind's training objective returns: `LossStats` (weighted sum, the weight, per-slot
accuracy, leading correct slots), so the loop in `draftflow.training.loop` is shared.

An objective (`draftflow/drafters/<kind>/objective.py`) turns a sequence into a batch (`batch(sample,
step, j)`), says its loss weight (`weight(batch)`) and computes the loss (`loss(drafter, batch)`); its
`n_slots` is the length of the accuracy statistics. What it does not know: optimizers, ranks,
checkpoints or where features come from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossStats:
    loss: torch.Tensor  # scalar: weighted CE / weight_sum
    weighted_sum: torch.Tensor  # scalar, differentiable
    weight_sum: float
    correct: torch.Tensor  # (B-1,) correct predictions per slot k=1..B-1
    valid: torch.Tensor  # (B-1,) supervised labels per slot
    leading: torch.Tensor  # (N,) leading correct slots per block

    @property
    def accuracy(self) -> torch.Tensor:
        return self.correct / self.valid.clamp_min(1)

    @property
    def tau_est(self) -> float:
        return 1.0 + self.leading.float().mean().item()


# ----------------------------------------------------------------------------- objectives
