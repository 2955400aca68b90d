"""Attention backends that apply a boolean mask: one signature, chosen from `ATTENTION_BACKENDS`.

"sdpa" uses the dense mask; "flex" (flex_attention, compiled on CUDA) turns the same mask into a
block-sparse `BlockMask` once per forward. The masks themselves are the kinds' (DFlash's block rule:
`draftflow/drafters/dflash/mask.py`). Knows nothing of the model's weights or of training.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

# ----------------------------------------------------------------------------- attention backends

# One signature: q (B, H, Q, hd), k/v (B, Hkv, K, hd), mask (B, Q, K) bool, scale -> (B, H, Q, hd).
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """PyTorch SDPA with an explicit boolean mask; GQA by kv-head broadcasting."""
    # Every query sees at least its own block, so no mask row is all False (no NaN rows).
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def dense_to_block_mask(mask: torch.Tensor) -> BlockMask:
    """A flex `BlockMask` allowing exactly the True entries of a (B, Q, K) bool mask.

    Built once per forward and mask kind; fully masked 128x128 tiles (other blocks,
    far context) are skipped by flex_attention, which is where its speed comes from.
    """
    n_b, n_q, n_k = mask.shape

    def mask_mod(b, h, q_idx, kv_idx):
        return mask[b, q_idx, kv_idx]

    return create_block_mask(mask_mod, n_b, None, n_q, n_k, device=mask.device, _compile=mask.is_cuda)


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    return torch.compile(flex_attention, dynamic=True)


def flex_attention_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float) -> torch.Tensor:
    """flex_attention over a `BlockMask` (a dense bool mask is converted first).

    Compiled on CUDA; eager elsewhere (forward only: torch has no flex backward on CPU).
    """
    block_mask = mask if isinstance(mask, BlockMask) else dense_to_block_mask(mask)
    fn = _compiled_flex() if q.is_cuda else flex_attention
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


ATTENTION_BACKENDS: dict[str, AttentionFn] = {"sdpa": sdpa_attention, "flex": flex_attention_backend}
# How each backend wants the mask, prepared once per forward (not once per layer).
MASK_PREPARERS: dict[str, Callable[[torch.Tensor], Any]] = {"sdpa": lambda m: m, "flex": dense_to_block_mask}


def resolve_backend(name: str, device: torch.device) -> str:
    """'auto' -> flex on CUDA, sdpa elsewhere; anything else as given."""
    if name == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    return name
