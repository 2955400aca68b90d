"""DFlash's attention rule (arXiv 2602.06036): the one definition of what a block query may see.

`block_attention_mask`: context strictly before its anchor, its own block bidirectionally, no other block.
`sliding_window_mask` narrows it for sliding-window layers. The backends that apply a mask are
`draftflow.models.attention`'s.
"""

from __future__ import annotations

import torch


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
