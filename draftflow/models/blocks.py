"""The Qwen3 building blocks every drafter kind uses: RoPE tables, RMSNorm, the SwiGLU MLP, and the
dimensions a drafter copies from its target's config (`target_dims`).

Each is HF Qwen3's computation with HF's parameter names, so a drafter built from them exports by a
rename table. What it does not know: attention (each drafter's differs: DFlash's keys/values also
cover the target's features, EAGLE-3's queries read [embedding, hidden] twice as wide).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from draftflow.compat import rope_theta

# ----------------------------------------------------------------------------- RoPE


def rope_cos_sin(
    pos: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Default (unscaled) RoPE tables for absolute positions, as in HF Qwen3.

    Args:
        pos: (B, L) int positions.

    Returns:
        cos, sin: (B, 1, L, head_dim), broadcastable over heads.
    """
    exps = torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exps)  # (head_dim/2,)
    freqs = pos.to(torch.float32)[..., None] * inv_freq  # (B, L, head_dim/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (B, L, head_dim)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, L, hd) by the tables (HF's rotate_half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


# ----------------------------------------------------------------------------- Qwen3 blocks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg):  # any config with hidden_size and intermediate_size
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def target_dims(target_config: Any) -> dict[str, Any]:
    """The dimensions a drafter copies from its target's HF config (Qwen3/Llama-like fields)."""
    heads = int(target_config.num_attention_heads)
    return {
        "hidden_size": int(target_config.hidden_size),
        "num_heads": heads,
        "num_kv_heads": int(getattr(target_config, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(target_config, "head_dim", None) or target_config.hidden_size // heads),
        "intermediate_size": int(target_config.intermediate_size),
        "rms_norm_eps": float(target_config.rms_norm_eps),
        "rope_theta": rope_theta(target_config),
        "vocab_size": int(target_config.vocab_size),
    }
