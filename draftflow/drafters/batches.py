"""The step plan every drafter kind trains by: epochs, length buckets, the seeded generators. Each kind
builds its own batches (`draftflow/drafters/<kind>/batches.py`); the LR schedule is training's
(`draftflow.training.schedule`).

Every random choice derives from (seed, step), so a resumed run draws exactly what an uninterrupted
one would. Knows nothing of any model nor of the training loop.
"""

from __future__ import annotations

import math

import torch

from draftflow.config import TrainConfig

IGNORE = -100  # the label of a position no loss reads


# ----------------------------------------------------------------------------- schedule & plan


def total_steps(n_samples: int, tcfg: TrainConfig) -> int:
    """Optimizer steps: epochs * ceil(n / batch_size), capped by max_steps."""
    steps = tcfg.epochs * math.ceil(n_samples / tcfg.batch_size)
    return min(steps, tcfg.max_steps) if tcfg.max_steps else steps


BUCKET_BATCHES = 16  # batches per length-sorted pool: similar lengths, still well mixed


def step_indices(step: int, n_samples: int, tcfg: TrainConfig, lengths: list[int] | None = None) -> list[int]:
    """Sample indices of optimizer step `step`: a seeded shuffle per epoch, cut in batches.

    With `lengths`, batch_size > 1 and `tcfg.length_buckets`, the shuffled epoch is cut in
    pools of BUCKET_BATCHES batches, each pool sorted by length and cut into batches, and
    the batch order shuffled again: steps hold similar lengths. Everything derives from
    (seed, epoch), so resume needs no state.
    """
    B = tcfg.batch_size
    per_epoch = math.ceil(n_samples / B)
    epoch, k = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(tcfg.seed * 100_003 + epoch)
    order = torch.randperm(n_samples, generator=g).tolist()
    if lengths is None or B == 1 or not tcfg.length_buckets:
        return order[k * B : (k + 1) * B]
    pool = B * BUCKET_BATCHES
    batches = []
    for i in range(0, n_samples, pool):
        chunk = sorted(order[i : i + pool], key=lambda s: lengths[s])  # stable: ties keep shuffle order
        batches += [chunk[j : j + B] for j in range(0, len(chunk), B)]
    return batches[int(torch.randperm(len(batches), generator=g)[k])]


# ----------------------------------------------------------------------------- sampled softmax


def step_generator(seed: int, step: int, j: int) -> torch.Generator:
    """The RNG of the j-th sequence in step `step` (DFlash's anchors, a sampled softmax's draws): derived, so a resume
    needs no RNG replay."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 4096 + j)


def sampled_vocab(labels: torch.Tensor, keep: torch.Tensor, vocab_size: int, negatives: int,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens a sampled-softmax step scores, and their log-Q correction.

    Every id in `keep` (the supervised tokens tokenize counted) and in `labels` is scored exactly
    (bias 0); `negatives` more are drawn uniformly without replacement from the rest of the
    vocabulary, each biased by log(rest / negatives) so the sum over them estimates the rest's share
    of the softmax's normaliser (Bengio & Senecal 2008; Jean et al. 2015, arXiv 1412.2007).

    Returns:
        (sorted ids (K,), bias (K,) float32).
    """
    exact = torch.cat([keep, labels[labels != IGNORE]]).unique()
    rest = torch.ones(vocab_size, dtype=torch.bool)
    rest[exact] = False
    pool = rest.nonzero().squeeze(1)
    drawn = pool[torch.randperm(pool.numel(), generator=generator)[: min(negatives, pool.numel())]]
    ids, order = torch.cat([exact, drawn]).sort()
    bias = torch.zeros(ids.numel())
    if drawn.numel():
        bias[exact.numel():] = math.log(pool.numel() / drawn.numel())
    return ids, bias[order]
