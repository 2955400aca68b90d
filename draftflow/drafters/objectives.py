"""What every kind's training objective returns: `LossStats` (weighted sum, the weight, per-slot
accuracy, leading correct slots), so the loop in `draftflow.training.loop` is shared.

An objective (`draftflow/drafters/<kind>/objective.py`) turns a sequence into a batch (`batch(sample,
step, j)`), says its loss weight (`weight(batch)`) and computes the loss (`loss(drafter, batch)`); its
`n_slots` is the length of the accuracy statistics. What it does not know: optimizers, ranks,
checkpoints or where features come from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class ObjectiveOptions:
    """The objective's options beyond a kind's paper recipe (the `drafter` section, resolved by `train.recipe`).

    distill_top_k: 0 = hard labels (the regenerated token); k > 0 = soft labels, the target's top-k
        probabilities renormalised; None = the kind's paper labels (DFlash hard, EAGLE-3 the target's whole
        draft-vocabulary distribution).
    acceptance_loss: add the gradient of each block's expected accepted length (`chain_gain`).
    """

    distill_top_k: int | None = None
    acceptance_loss: bool = False

    @classmethod
    def of(cls, drafter: Any) -> ObjectiveOptions:
        return cls(getattr(drafter, "distill_top_k", None), bool(getattr(drafter, "acceptance_loss", False)))


# `train.gamma: measured`: a slot (an EAGLE-3 unroll step) decoding reaches less often than this is trained at this
# weight (DFlash: one pass scores every slot) or not unrolled (EAGLE-3: each step is a whole pass).
REACH_FLOOR = 0.01


def reach(acceptance: list[float], n: int) -> list[float]:
    """P(decoding reaches draft k), k = 1..n, from held-out `acceptance[k-1]` = P(at least k drafts accepted): 1 for
    the first draft, then `acceptance`, 0 past what was measured."""
    out = [1.0, *acceptance][:n]
    return out + [0.0] * (n - len(out))


def top_k_targets(target_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-k tokens and their probabilities renormalised over those k: ((..., k) ids, (..., k) p).

    Soft labels for distillation (arXiv 2503.07807: distilling the target's distribution beats its text alone);
    sparse, so their cost is k per position, not the vocabulary."""
    values, ids = target_logits.float().topk(min(k, target_logits.shape[-1]), dim=-1)
    return ids, torch.softmax(values, dim=-1)


def slot_terms(logits: torch.Tensor, labels: torch.Tensor, soft: tuple[torch.Tensor, torch.Tensor] | None,
               acceptance: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and acceptance probability of the drafter's `logits` (R, V) against its labels.

    Args:
        labels: (R,) token columns (any value where unsupervised: the caller masks those rows).
        soft: None for hard labels, else the target's (ids (R, k), probabilities (R, k)) in the same columns.
        acceptance: the row's loss is -log(acceptance) (LK losses, arXiv 2602.23881) instead of the cross
            entropy; with hard labels the two are equal.

    Returns:
        (loss (R,), alpha (R,)): alpha is the chance the row's draft is accepted, q(label) for hard labels and
        sum_v min(p_v, q_v) for soft ones (speculative sampling's acceptance rate).
    """
    logq = torch.log_softmax(logits.float(), dim=-1)
    if soft is None:
        ce = -logq.gather(-1, labels.clamp_min(0)[:, None])[:, 0]
        return ce, torch.exp(-ce)
    ids, p = soft
    logq_k = logq.gather(-1, ids)  # (R, k)
    ce = -(p * logq_k).sum(-1)
    alpha = torch.minimum(p, logq_k.exp()).sum(-1)
    return (-torch.log(alpha.clamp_min(1e-9)) if acceptance else ce), alpha


def chain_gain(alpha: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(N, K) weights whose weighted -log(alpha) has the gradient of minus each chain's expected accepted length.

    A chain of K drafts (a DFlash block, an EAGLE-3 unroll) accepts draft j only if drafts 1..j are all
    accepted: E[accepted] = sum_k prod_{i<=k} alpha_i. Its gradient is sum_j R_j * grad log(alpha_j) with
    R_j = sum_{k>=j} prod_{i<=k} alpha_i, the accepted drafts that depend on draft j. So R (detached) weights
    each draft by what its acceptance is worth; an unsupervised draft ends the chain.
    """
    reach = torch.cumprod(alpha.detach() * valid, dim=1)  # (N, K) chance the chain accepts drafts 1..k
    return reach.flip(1).cumsum(1).flip(1) * valid
