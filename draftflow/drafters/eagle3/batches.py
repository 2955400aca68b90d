"""EAGLE-3 training batches: one unroll per sequence, aligned as `draftflow/drafters/eagle3/model.py`
writes down (row t of step i reads x_{t+1+i} and predicts x_{t+2+i}).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftflow.features import FeatureSample


@dataclass
class Eagle3Batch:
    """EAGLE-3 unroll inputs for one sequence of T tokens: R = T-1 rows, K steps."""

    feats: torch.Tensor  # (1, R, 3D) taps of positions 0..T-2
    step_ids: torch.Tensor  # (1, K, R) step i, row t: token x_{t+1+i} (0 past the end)
    pos: torch.Tensor  # (1, R) RoPE positions of step 0
    final: torch.Tensor  # (1, T, D) target's final normed hidden states, positions 0..T-1
    supervised: torch.Tensor  # (1, K, R) bool: x_{t+2+i} exists and loss_mask[t+2+i]
    read: torch.Tensor  # (1, T) bool: positions whose target distribution a supervised row is scored against
    key: str = ""  # the sequence's sample id: what the target computed for it once is kept under it
    # train.sampled_softmax: the draft ids the head scores (sorted) and their log-Q bias (`batches.sampled_vocab`);
    # None = the whole draft vocabulary
    vocab: torch.Tensor | None = None
    vocab_bias: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> Eagle3Batch:
        return Eagle3Batch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()})


def make_eagle3_batch(sample: FeatureSample, steps: int) -> Eagle3Batch | None:
    """The unroll batch of one sequence (features: 3 taps then FINAL), or None when nothing is supervised.

    Step i, row t: input token x_{t+1+i}, target distribution from f_{t+1+i} (predicting
    x_{t+2+i}), supervised iff t+2+i < T and loss_mask[t+2+i] (see `draftflow.drafters.eagle3.model`).
    """
    T = sample.input_ids.numel()
    if T < 3:
        return None
    ids, mask = sample.input_ids.to(torch.int64), sample.loss_mask.bool()
    R = T - 1
    src = torch.arange(R)[None, :] + 1 + torch.arange(steps)[:, None]  # (K, R): position t+1+i
    step_ids = torch.where(src < T, ids[src.clamp(max=T - 1)], 0)
    pred = src + 1  # position of the predicted token
    supervised = (pred < T) & mask[pred.clamp(max=T - 1)]
    if not supervised.any():
        return None
    hidden = sample.hidden  # (T, 4, D)
    # step i, row t reads position p = t+1+i and is supervised iff loss_mask[p+1]: at any unroll depth the positions
    # read are those followed by a supervised token (step 0, row p-1 reaches each), never position 0
    read = torch.zeros(T, dtype=torch.bool)
    read[1:-1] = mask[2:]
    return Eagle3Batch(
        feats=hidden[:R, :3].reshape(1, R, -1),
        step_ids=step_ids[None],
        pos=torch.arange(R)[None],
        final=hidden[:, 3][None],
        supervised=supervised[None],
        read=read[None],
        key=sample.sample_id,
    )
