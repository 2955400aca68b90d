"""DFlash attention: the one mask rule, and the attention backends that apply it.

`block_attention_mask` is the single definition of what a block query may see
(DFlash paper, arXiv 2602.06036): context strictly before its anchor, its own
block bidirectionally, no other block. `sliding_window_mask` narrows it for
sliding-window layers. Backends share one signature and come from
`ATTENTION_BACKENDS`: "sdpa" uses the dense mask; "flex" (flex_attention,
compiled on CUDA) turns the same mask into a block-sparse `BlockMask` once per
forward. Knows nothing of the model's weights or of training.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

# ----------------------------------------------------------------------------- mask rule


def block_attention_mask(anchors: torch.Tensor, block_size: int, ctx_len: int) -> torch.Tensor:
    """Which keys each block query may see (True = attend).

    Keys are laid out [context positions 0..C-1, then all Q = N*B block slots].

    Args:
        anchors: (N,) int anchor positions a_j, one block each.
        block_size: B.
        ctx_len: C, number of context positions (features at positions 0..C-1).

    Returns:
        (N*B, C + N*B) bool.
    """
    n_q = anchors.numel() * block_size
    q_block = torch.arange(n_q, device=anchors.device) // block_size  # (Q,) block of each query
    ctx_pos = torch.arange(ctx_len, device=anchors.device)  # (C,)
    # DFlash: context strictly before the anchor (`<`, not `<=`). The feature at a_j is the
    # target's state after reading token a_j; at inference the anchor is the target's fresh
    # output, which it has not read yet, so that feature does not exist then.
    sees_ctx = ctx_pos[None, :] < anchors[q_block][:, None]  # (Q, C)
    # DFlash: bidirectional inside a block (no causal mask), nothing across blocks.
    sees_block = q_block[:, None] == q_block[None, :]  # (Q, Q)
    return torch.cat([sees_ctx, sees_block], dim=1)


def sliding_window_mask(full_mask: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Narrow a `block_attention_mask` for a sliding-window layer, by absolute positions.

    A query at position p keeps a key at position k iff the full rule allows it, k <= p
    and p - k < window (the HF/vLLM sliding-window convention: the query itself counts).

    Args:
        full_mask: (B, Q, K) or (Q, K) bool from `block_attention_mask`.
        q_pos: (B, Q) or (Q,) query positions; k_pos: (B, K) or (K,) key positions
            (context positions, then block slot positions).
        window: the layer's sliding window.

    Returns:
        A bool mask shaped like `full_mask`.
    """
    dist = q_pos[..., :, None] - k_pos[..., None, :]  # (..., Q, K) query pos - key pos
    # DFlash (sliding layers): CAUSAL inside the block (k <= p), as vLLM serves them, and
    # context only within the window; full layers stay bidirectional inside the block.
    return full_mask & (dist >= 0) & (dist < window)


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
