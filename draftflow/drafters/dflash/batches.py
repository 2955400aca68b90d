"""DFlash training batches: anchored blocks.

Per sequence (DFlash paper, arXiv 2602.06036): up to `num_anchors` random anchors among supervised
positions; block j = [token a_j, mask x (B-1)] at positions a_j..a_j+B-1; slot k's label is token a_j+k
(slot 0, the given anchor, is not predicted). Knows nothing of the model's internals beyond the mask rule
it imports, nor of the training loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftflow.drafters.batches import IGNORE
from draftflow.drafters.dflash.mask import block_attention_mask
from draftflow.features import FeatureSample


@dataclass
class BlockBatch:
    """Drafter inputs and labels for one sequence; Q = n_blocks * B."""

    anchors: torch.Tensor  # (N,) sorted anchor positions
    block_ids: torch.Tensor  # (1, Q)
    block_pos: torch.Tensor  # (1, Q)
    ctx_hidden: torch.Tensor  # (1, T, n_taps*D)
    ctx_pos: torch.Tensor  # (1, T)
    attn_mask: torch.Tensor  # (1, Q, T+Q) bool
    labels: torch.Tensor  # (1, Q) int64, IGNORE at slot 0 and unsupervised targets
    vocab: torch.Tensor | None = None  # (K,) sorted token ids scored (train.sampled_softmax), else all
    vocab_bias: torch.Tensor | None = None  # (K,) log-Q correction added to those logits
    final: torch.Tensor | None = None  # (1, T, D) the target's final normed states (drafter.distill_top_k)

    def to(self, device: torch.device | str) -> BlockBatch:
        return BlockBatch(**{k: None if v is None else v.to(device) for k, v in vars(self).items()})


def select_anchors(
    loss_mask: torch.Tensor, block_size: int, num_anchors: int, generator: torch.Generator
) -> torch.Tensor:
    """Uniformly sample up to `num_anchors` anchors, sorted.

    Eligible a: loss_mask[a] is set, a >= 1 (some context exists) and the block fits
    (a + B <= T). Returns an empty (0,) tensor when none is eligible.
    """
    T = loss_mask.numel()
    pos = torch.arange(T)
    ok = loss_mask.bool().cpu() & (pos >= 1) & (pos + block_size <= T)
    cand = pos[ok]
    if cand.numel() > num_anchors:
        cand = cand[torch.randperm(cand.numel(), generator=generator)[:num_anchors]]
    return cand.sort().values


def make_block_batch(sample: FeatureSample, anchors: torch.Tensor, block_size: int, mask_token_id: int) -> BlockBatch:
    """Drafter inputs and labels for given anchors (see module docstring for the rule)."""
    T, B = sample.input_ids.numel(), block_size
    ids = sample.input_ids.to(torch.int64)
    slot = torch.arange(B)  # (B,)
    pos = anchors[:, None] + slot[None, :]  # (N, B) absolute position of every slot
    block_ids = torch.full_like(pos, mask_token_id)
    block_ids[:, 0] = ids[anchors]  # slot 0 holds the anchor token itself
    # Slot k predicts the token at its own position a+k (no shift): label = ids[a+k].
    labels = torch.where(sample.loss_mask.bool()[pos], ids[pos], IGNORE)
    labels[:, 0] = IGNORE  # the anchor is given, not predicted
    return BlockBatch(
        anchors=anchors,
        block_ids=block_ids.reshape(1, -1),
        block_pos=pos.reshape(1, -1),
        ctx_hidden=sample.hidden.reshape(1, T, -1),  # taps concatenated in tap order
        ctx_pos=torch.arange(T)[None],
        attn_mask=block_attention_mask(anchors, B, T)[None],
        labels=labels.reshape(1, -1),
    )


def build_training_batch(
    sample: FeatureSample,
    block_size: int,
    num_anchors: int,
    generator: torch.Generator,
    mask_token_id: int,
) -> BlockBatch | None:
    """Random anchors plus their blocks for one sequence.

    Args:
        sample: one sequence's ids, loss mask and (T, n_taps, D) tap features.
        block_size: B.
        num_anchors: at most this many blocks (paper: 512).
        generator: the only source of randomness (anchor choice).
        mask_token_id: id filling slots 1..B-1.

    Returns:
        A `BlockBatch`, or None when the sequence has no eligible anchor.
    """
    anchors = select_anchors(sample.loss_mask, block_size, num_anchors, generator)
    if anchors.numel() == 0:
        return None
    return make_block_batch(sample, anchors, block_size, mask_token_id)
