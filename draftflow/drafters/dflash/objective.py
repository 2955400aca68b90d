"""The DFlash objective (arXiv 2602.06036): random anchored blocks; slot k of a block predicts token
anchor+k and its cross entropy is weighted exp(-(k-1)/gamma).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftflow.config import TrainConfig
from draftflow.drafters.batches import IGNORE, anchor_generator
from draftflow.drafters.dflash.batches import BlockBatch, build_training_batch, sampled_vocab
from draftflow.drafters.dflash.config import DFlashConfig
from draftflow.drafters.objectives import LossStats
from draftflow.features import FeatureSample

# Paper's loss decay per block size: gamma = 7, 5, 4 for B = 16, 10, 8.
PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """The paper's gamma for B = 16/10/8; otherwise (B-1)/2, which tracks those values
    (7.5/4.5/3.5) and keeps the weight of the last slot near exp(-2)."""
    return PAPER_GAMMA.get(block_size, max(0.5, (block_size - 1) / 2))


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
