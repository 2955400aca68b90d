"""The drafters' training objectives: how a sequence becomes a batch, its loss weight, and the loss.

DFlash (arXiv 2602.06036): random anchored blocks; slot k of a block predicts token anchor+k and
its cross entropy is weighted exp(-(k-1)/gamma). EAGLE-3 (arXiv 2503.01840): the training-time-test
unroll of `draftflow.models.eagle3`, step i's soft cross entropy against the target's distribution
over the draft vocabulary weighted `ttt_decay ** i`. Both return `LossStats` (weighted sum, the
weight, per-slot accuracy, leading correct slots), so the loop in `draftflow.training.loop` is shared.

What it does not know: optimizers, ranks, checkpoints or where features come from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draftflow.config import TrainConfig
from draftflow.drafters.batches import (
    IGNORE,
    BlockBatch,
    Eagle3Batch,
    anchor_generator,
    build_training_batch,
    make_eagle3_batch,
    sampled_vocab,
)
from draftflow.features import FeatureSample
from draftflow.models.dflash_config import DFlashConfig
from draftflow.models.eagle3 import Eagle3Config

# Paper's loss decay per block size: gamma = 7, 5, 4 for B = 16, 10, 8.
PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """The paper's gamma for B = 16/10/8; otherwise (B-1)/2, which tracks those values
    (7.5/4.5/3.5) and keeps the weight of the last slot near exp(-2)."""
    return PAPER_GAMMA.get(block_size, max(0.5, (block_size - 1) / 2))


# ----------------------------------------------------------------------------- loss


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


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """(B,) loss weights: 0 for slot 0, exp(-(k-1)/gamma) for slot k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), torch.zeros(()))


def dflash_loss(logits: torch.Tensor, labels: torch.Tensor, block_size: int, gamma: float) -> LossStats:
    """Decayed block cross entropy plus accuracy statistics.

    Args:
        logits: (1, Q, V) drafter logits, Q = N * B.
        labels: (1, Q) targets, IGNORE where unsupervised (always at slot 0).
        block_size: B.
        gamma: decay; slot k has weight exp(-(k-1)/gamma).

    Returns:
        `LossStats`; `loss` is normalised by the summed weight of valid slots.
        A block's leading count stops at its first wrong or unsupervised slot.
    """
    V = logits.shape[-1]
    flat = labels.reshape(-1)
    ce = F.cross_entropy(logits.reshape(-1, V).float(), flat, ignore_index=IGNORE, reduction="none")
    valid = (flat != IGNORE).view(-1, block_size)  # (N, B)
    w = slot_weights(block_size, gamma).to(logits.device)[None, :] * valid  # (N, B)
    weighted_sum = (ce.view(-1, block_size) * w).sum()
    weight_sum = float(w.sum())
    hit = (logits.detach().argmax(-1).reshape(-1) == flat).view(-1, block_size) & valid
    leading = hit[:, 1:].int().cumprod(dim=1).sum(dim=1)  # (N,)
    return LossStats(
        loss=weighted_sum / max(weight_sum, 1e-12),
        weighted_sum=weighted_sum,
        weight_sum=weight_sum,
        correct=hit[:, 1:].sum(0).cpu().double(),
        valid=valid[:, 1:].sum(0).cpu().double(),
        leading=leading.cpu(),
    )


def eagle3_loss(logits: list[torch.Tensor], probs: torch.Tensor, in_vocab: torch.Tensor,
                supervised: torch.Tensor, decay: float) -> LossStats:
    """Decayed soft cross entropy over the unroll steps, plus accuracy statistics.

    Args:
        logits: K drafter logits (1, R, Vd), R = T-1 rows.
        probs: (1, T, Vd) the target's distribution over the draft vocabulary at every position;
            step i, row t is scored against position t+1+i.
        in_vocab: (1, T) the target's argmax at that position is a draft token.
        supervised: (1, K, R) bool from `make_eagle3_batch`.
        decay: step i has weight decay ** i.

    Returns:
        `LossStats` per step (correct/valid of length K; a row's leading count stops at its first
        wrong or unsupervised step; rows = those supervised at step 0). `weight_sum` counts the
        supervised rows; rows whose target argmax is outside the draft vocabulary add nothing to
        `weighted_sum` but stay in `weight_sum` (known before the forward pass, like SpecForge's
        mean over positions).
    """
    R = supervised.shape[-1]
    weighted_sum = logits[0].new_zeros((), dtype=torch.float32)
    hits, valids, weight_sum = [], [], 0.0
    for i, lg in enumerate(logits):
        p = probs[:, 1 + i : 1 + i + R]  # (1, R_i, Vd), R_i = R - i rows have a target position
        n = p.shape[1]
        valid = supervised[:, i, :n] & in_vocab[:, 1 + i : 1 + i + n]  # (1, R_i)
        ce = -(p * F.log_softmax(lg[:, :n].float(), dim=-1)).sum(-1)  # (1, R_i)
        w = decay**i
        weighted_sum = weighted_sum + w * (ce * valid).sum()
        weight_sum += w * float(supervised[:, i].sum())
        hit = (lg[:, :n].detach().argmax(-1) == p.argmax(-1)) & valid
        hits.append(F.pad(hit[0], (0, R - n)))
        valids.append(F.pad(valid[0], (0, R - n)))
    hit, valid = torch.stack(hits), torch.stack(valids)  # (K, R)
    leading = hit.int().cumprod(dim=0).sum(dim=0)[valid[0]]  # rows supervised at step 0
    return LossStats(
        loss=weighted_sum / max(weight_sum, 1e-12),
        weighted_sum=weighted_sum,
        weight_sum=weight_sum,
        correct=hit.sum(1).cpu().double(),
        valid=valid.sum(1).cpu().double(),
        leading=leading.cpu(),
    )


# ----------------------------------------------------------------------------- objectives


class DFlashObjective:
    """DFlash: random anchored blocks, the decayed block cross entropy."""

    def __init__(self, cfg: DFlashConfig, tcfg: TrainConfig):
        self.cfg, self.tcfg, self.B = cfg, tcfg, cfg.block_size
        self.gamma = tcfg.gamma or default_gamma(cfg.block_size)
        self.weights = slot_weights(cfg.block_size, self.gamma)
        self.n_slots = cfg.block_size - 1
        # train.sampled_softmax: the supervised token ids always scored (set by the loop from tokenize's counts).
        self.loss_tokens: torch.Tensor | None = None

    def batch(self, sample: FeatureSample, step: int, j: int) -> BlockBatch | None:
        gen = anchor_generator(self.tcfg.seed, step, j)
        b = build_training_batch(sample, self.B, self.tcfg.num_anchors, gen, self.cfg.mask_token_id)
        if b is not None and self.tcfg.sampled_softmax and self.loss_tokens is not None:  # same generator: resumable
            b.vocab, b.vocab_bias = sampled_vocab(b.labels, self.loss_tokens, self.cfg.vocab_size,
                                                  self.tcfg.sampled_softmax, gen)
        return b

    def weight(self, b: BlockBatch) -> float:
        return float((self.weights * (b.labels.view(-1, self.B) != IGNORE)).sum())

    def loss(self, drafter, b: BlockBatch) -> LossStats:
        logits = drafter(b.block_ids, b.block_pos, b.ctx_hidden, b.ctx_pos, b.attn_mask, b.vocab, b.vocab_bias)
        labels = b.labels
        if b.vocab is not None:  # label ids -> their column among the scored tokens (accuracy is within them)
            labels = torch.where(labels == IGNORE, labels, torch.searchsorted(b.vocab, labels.clamp_min(0)))
        return dflash_loss(logits, labels, self.B, self.gamma)


class Eagle3Objective:
    """EAGLE-3: the training-time-test unroll, soft targets over the draft vocabulary."""

    def __init__(self, cfg: Eagle3Config, tcfg: TrainConfig):
        self.cfg, self.n_slots = cfg, cfg.ttt_steps
        self.decays = [cfg.ttt_decay**i for i in range(cfg.ttt_steps)]

    def batch(self, sample: FeatureSample, step: int, j: int) -> Eagle3Batch | None:
        return make_eagle3_batch(sample, self.cfg.ttt_steps)  # deterministic: every row is used

    def weight(self, b: Eagle3Batch) -> float:
        return sum(d * float(b.supervised[0, i].sum()) for i, d in enumerate(self.decays))

    def loss(self, drafter, b: Eagle3Batch) -> LossStats:
        logits, probs, in_vocab = drafter(b.feats, b.step_ids, b.pos, b.final)
        return eagle3_loss(logits, probs, in_vocab, b.supervised, self.cfg.ttt_decay)

