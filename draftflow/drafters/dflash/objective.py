"""The DFlash objective (arXiv 2602.06036): random anchored blocks; slot k of a block predicts token
anchor+k and its cross entropy is weighted exp(-(k-1)/gamma).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftflow.config import DrafterConfig, TrainConfig
from draftflow.drafters.batches import IGNORE, sampled_vocab, step_generator
from draftflow.drafters.dflash.batches import BlockBatch, build_training_batch
from draftflow.drafters.dflash.config import DFlashConfig
from draftflow.drafters.objectives import (
    REACH_FLOOR,
    LossStats,
    ObjectiveOptions,
    chain_gain,
    reach,
    slot_terms,
    top_k_targets,
)
from draftflow.features import FeatureSample

# Paper's loss decay per block size: gamma = 7, 5, 4 for B = 16, 10, 8.
PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
# `train.gamma: measured` (draftflow recipe's default, an option of the paper's): slot k weighs the measured
# probability that decoding reaches it, P(the drafts before it accepted), from each held-out measurement. The
# paper's fixed decay spreads the loss over every slot; at tau ~1.2-1.3 slot 1 holds ~90% of the accepted drafts.
# On SmolLM2's rehearsal features, 300 steps, layers from the target, held-out tau (docs/results.md "Recipes"):
# fixed gamma 4 (the paper's for B = 8) 1.213, 2: 1.238, 1: 1.283, 0.5: 1.314, 0.25: 1.292; the measured weights
# find that regime's ~0.5-0.8 themselves and spread out again as acceptance grows (at tau 6 the reach falls about
# as the paper's gamma 7 does).


def reach_weights(acceptance: list[float], block_size: int) -> torch.Tensor:
    """(B,) loss weights from held-out acceptance (`acceptance[k-1]` = P(at least k drafts accepted)): 0 for slot
    0, P(at least k-1 accepted) for slot k >= 1 (1 for slot 1), at least `REACH_FLOOR`."""
    # a slot decoding rarely reaches still learns a little (its reach can then grow)
    return torch.tensor([0.0] + [max(r, REACH_FLOOR) for r in reach(acceptance, block_size - 1)], dtype=torch.float32)


def default_gamma(block_size: int) -> float:
    """The paper's gamma for B = 16/10/8; otherwise (B-1)/2, which tracks those values
    (7.5/4.5/3.5) and keeps the weight of the last slot near exp(-2)."""
    return PAPER_GAMMA.get(block_size, max(0.5, (block_size - 1) / 2))


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """(B,) loss weights: 0 for slot 0, exp(-(k-1)/gamma) for slot k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), torch.zeros(()))


def dflash_loss(logits: torch.Tensor, labels: torch.Tensor, block_size: int, gamma: float,
                soft: tuple[torch.Tensor, torch.Tensor] | None = None, acceptance: bool = False,
                weights: torch.Tensor | None = None) -> LossStats:
    """Decayed block cross entropy plus accuracy statistics.

    Args:
        logits: (1, Q, V) drafter logits, Q = N * B.
        labels: (1, Q) targets, IGNORE where unsupervised (always at slot 0).
        block_size: B.
        gamma: decay; slot k has weight exp(-(k-1)/gamma).
        soft: the target's top-k (ids (Q, k), probabilities (Q, k)) per slot, in the logits' columns
            (`drafter.distill_top_k`); None = the hard labels (the paper).
        acceptance: `drafter.acceptance_loss`: each slot's loss is -log(acceptance) and its weight adds the
            accepted drafts that depend on it (`objectives.chain_gain`).
        weights: (B,) slot weights in place of gamma's decay (a kind that weights its slots otherwise).

    Returns:
        `LossStats`; `loss` is normalised by the summed decay weight of valid slots (the paper's; the
        acceptance weights come on top). A block's leading count stops at its first wrong or unsupervised slot.
    """
    V = logits.shape[-1]
    flat = labels.reshape(-1)
    valid = (flat != IGNORE).view(-1, block_size)  # (N, B)
    w = (slot_weights(block_size, gamma) if weights is None else weights).to(logits.device)[None, :] * valid  # (N, B)
    weight_sum = float(w.sum())
    if soft is None and not acceptance:  # the paper's recipe, exactly
        ce = F.cross_entropy(logits.reshape(-1, V).float(), flat, ignore_index=IGNORE, reduction="none")
        weighted_sum = (ce.view(-1, block_size) * w).sum()
    else:
        terms, alpha = slot_terms(logits.reshape(-1, V), flat, soft, acceptance)
        terms, alpha = terms.view(-1, block_size), alpha.view(-1, block_size)
        if acceptance:  # slot 0 is the given anchor: the chain is slots 1..B-1
            w = w + F.pad(chain_gain(alpha[:, 1:], valid[:, 1:].float()), (1, 0))
        weighted_sum = torch.where(valid, terms * w, 0.0).sum()
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


HELDOUT_STEP = 1 << 40  # the anchors of held-out blocks: a seed no training step uses


class DFlashObjective:
    """DFlash: random anchored blocks, the decayed block cross entropy (and the `ObjectiveOptions`)."""

    def __init__(self, cfg: DFlashConfig, tcfg: TrainConfig, drafter: DrafterConfig | None = None):
        self.cfg, self.tcfg, self.B = cfg, tcfg, cfg.block_size
        # `measured` (draftflow's recipe): the paper's decay until the first held-out measurement (a warm start's is
        # at step 0), then `reweight`
        self.measured = tcfg.gamma == "measured"
        self.gamma = tcfg.gamma if isinstance(tcfg.gamma, float) else default_gamma(cfg.block_size)
        self.weights = slot_weights(cfg.block_size, self.gamma)
        self.n_slots = cfg.block_size - 1
        self.options = ObjectiveOptions(cfg.distill_top_k, cfg.acceptance_loss)
        # train.sampled_softmax: the supervised token ids always scored (set by the loop from tokenize's counts).
        self.loss_tokens: torch.Tensor | None = None

    def _blocks(self, sample: FeatureSample, gen: torch.Generator) -> BlockBatch | None:
        n, final = self.cfg.num_taps, None
        if self.cfg.stores_final:  # features: the taps, then the target's final state (soft labels' source)
            final = sample.hidden[:, n]
        if sample.hidden.shape[1] > n:  # the final state is not a context feature
            sample = FeatureSample(sample.sample_id, sample.input_ids, sample.loss_mask, sample.hidden[:, :n])
        b = build_training_batch(sample, self.B, self.tcfg.num_anchors, gen, self.cfg.mask_token_id)
        if b is not None and final is not None:
            b.final = final[None]
        return b

    def batch(self, sample: FeatureSample, step: int, j: int) -> BlockBatch | None:
        gen = step_generator(self.tcfg.seed, step, j)
        b = self._blocks(sample, gen)
        if b is not None and self.tcfg.sampled_softmax and self.loss_tokens is not None:  # same generator: resumable
            b.vocab, b.vocab_bias = sampled_vocab(b.labels, self.loss_tokens, self.cfg.vocab_size,
                                                  self.tcfg.sampled_softmax, gen)
        return b

    def reweight(self, acceptance: list[float]) -> None:
        """After a held-out measurement (the training loop calls it, and again on resume from the history): under
        `train.gamma: measured`, slot k weighs the measured probability that decoding reaches it."""
        if self.measured:
            self.weights = reach_weights(acceptance, self.B)

    def heldout_batch(self, sample: FeatureSample, j: int) -> BlockBatch | None:
        """Blocks of a held-out sequence at fixed anchors, scored over the whole vocabulary (as decoding is)."""
        return self._blocks(sample, step_generator(self.tcfg.seed, HELDOUT_STEP, j))

    def weight(self, b: BlockBatch) -> float:
        return float((self.weights * (b.labels.view(-1, self.B) != IGNORE)).sum())

    def loss(self, drafter, b: BlockBatch) -> LossStats:
        logits = drafter(b.block_ids, b.block_pos, b.ctx_hidden, b.ctx_pos, b.attn_mask, b.vocab, b.vocab_bias)
        labels = b.labels
        if b.vocab is not None:  # label ids -> their column among the scored tokens (accuracy is within them)
            labels = torch.where(labels == IGNORE, labels, torch.searchsorted(b.vocab, labels.clamp_min(0)))
        soft = self._soft_labels(drafter, b) if self.options.distill_top_k else None
        return dflash_loss(logits, labels, self.B, self.gamma, soft, self.options.acceptance_loss, self.weights)

    @torch.no_grad()
    def _soft_labels(self, drafter, b: BlockBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's top-k at every slot, in the logits' columns: slot k's token a+k is what the target
        predicts from its final state at a+k-1 (its LM head is the drafter's, shared and frozen)."""
        head = drafter.lm_head.weight
        h = b.final[0, (b.block_pos[0] - 1).clamp_min(0)].to(head.dtype)  # (Q, D)
        target_logits = F.linear(h, head) if b.vocab is None else F.linear(h, head[b.vocab]) + b.vocab_bias
        return top_k_targets(target_logits, self.options.distill_top_k)
