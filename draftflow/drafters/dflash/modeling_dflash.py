"""DFlash drafter for transformers: `AutoModel.from_pretrained(export_dir, trust_remote_code=True)`.

draftflow copies this file, unchanged, into every vLLM-format DFlash export (next to its
`config.json`, whose `auto_map` names `modeling_dflash.DFlashDraftModel`), so it imports
only torch and transformers. It is the same network as `draftflow.drafters.dflash.model.DFlashDrafter`,
written again in one file with the exported parameter names (`fc`, `hidden_norm`,
`layers.N.*` as in HF Qwen3, `norm`). It holds no embedding and no LM head: both are the
target's, so the caller embeds the block with the target's input embedding and turns the
returned hidden states into logits with the target's LM head.

The config stays a plain `Qwen3Config` (`model_type: "qwen3"`) because vLLM reads the same
`config.json` (it picks its own DFlash model by `architectures: ["DFlashDraftModel"]`); the
DFlash fields ride along as extra keys: `dflash_config.target_layer_ids` (0-based decoder
layer L = the output of layer L = HF `hidden_states[L + 1]`), `dflash_config.mask_token_id`,
`block_size`.

Use (one block of `block_size` slots after a context of C tokens, batch B)::

    target = AutoModelForCausalLM.from_pretrained(TARGET)
    drafter = AutoModel.from_pretrained(EXPORT_DIR, trust_remote_code=True)
    out = target(context_ids, output_hidden_states=True)               # context_ids (B, C)
    taps = torch.cat([out.hidden_states[L + 1] for L in drafter.target_layer_ids], -1)  # raw, (B, C, n*D)
    block = torch.full((B, drafter.block_size), drafter.mask_token_id)
    block[:, 0] = anchor                                  # the target's next token (position C)
    noise = target.get_input_embeddings()(block)                       # (B, block_size, D)
    pos = torch.arange(C + drafter.block_size).expand(B, -1)           # context, then the block
    logits = target.lm_head(drafter(noise, taps, pos))                 # slot k drafts token C + k

Deliberately absent: KV caching of the context across drafting rounds, training losses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config

# ----------------------------------------------------------------------------- RoPE


def _rope_theta(config: Qwen3Config) -> float:
    """RoPE base: `rope_parameters["rope_theta"]` (transformers 5) or `rope_theta` (4.x)."""
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(config, "rope_theta", 10000.0))


def rope_cos_sin(pos: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """Plain (unscaled) RoPE tables for positions (B, L) -> cos, sin (B, 1, L, head_dim)."""
    exps = torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim
    freqs = pos.to(torch.float32)[..., None] * (1.0 / theta**exps)  # (B, L, head_dim/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, L, hd) by the tables (HF's rotate_half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


# ----------------------------------------------------------------------------- Qwen3 blocks


class DFlashRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class DFlashMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashAttention(nn.Module):
    """Qwen3 GQA attention whose keys/values also cover the projected context features."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.n_head, self.n_kv = config.num_attention_heads, config.num_key_value_heads
        self.hd = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.n_head * self.hd, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv * self.hd, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.n_head * self.hd, config.hidden_size, bias=False)
        self.q_norm = DFlashRMSNorm(self.hd, config.rms_norm_eps)  # per head, as in Qwen3
        self.k_norm = DFlashRMSNorm(self.hd, config.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_k, mask):
        """x (B, Q, D) block; ctx (B, C, D) normed context; mask (B, Q, C+Q) bool -> (B, Q, D)."""
        B, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, Q, self.n_head, self.hd)).transpose(1, 2)
        kv_in = torch.cat([ctx, x], dim=1)  # DFlash: context features are keys/values only
        K = kv_in.shape[1]
        k = self.k_norm(self.k_proj(kv_in).view(B, K, self.n_kv, self.hd)).transpose(1, 2)
        v = self.v_proj(kv_in).view(B, K, self.n_kv, self.hd).transpose(1, 2)  # (B, Hkv, K, hd)
        q, k = apply_rope(q, *rope_q), apply_rope(k, *rope_k)
        rep = self.n_head // self.n_kv  # GQA: each kv head serves `rep` query heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=self.hd**-0.5)
        return self.o_proj(y.transpose(1, 2).reshape(B, Q, self.n_head * self.hd))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, x, ctx, rope_q, rope_k, mask):
        # DFlash: ctx is already normed by `hidden_norm`; only the block goes through input_layernorm.
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_k, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


# ----------------------------------------------------------------------------- the drafter


class DFlashDraftModel(PreTrainedModel):
    """The DFlash drafter without the target's embedding and LM head (both shared with the target)."""

    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        dflash = getattr(config, "dflash_config", None) or {}
        self.target_layer_ids: list[int] = list(dflash.get("target_layer_ids", []))
        self.mask_token_id: int | None = dflash.get("mask_token_id")
        self.block_size: int | None = getattr(config, "block_size", None)
        D = config.hidden_size
        # DFlash: the taps' hidden states, concatenated in tap order, are fused to one width.
        self.fc = nn.Linear(len(self.target_layer_ids) * D, D, bias=False)
        self.hidden_norm = DFlashRMSNorm(D, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(D, config.rms_norm_eps)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, DFlashRMSNorm):
            nn.init.ones_(module.weight)

    def layer_mask(self, i: int, mask: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Layer i's mask: `mask` itself, narrowed by positions on sliding-window layers."""
        types = getattr(self.config, "layer_types", None)
        if not types or types[i] != "sliding_attention":
            return mask
        dist = q_pos[:, :, None] - k_pos[:, None, :]  # (B, Q, C+Q) query pos - key pos
        # Sliding layers: causal inside the block, context only within the window.
        return mask & (dist >= 0) & (dist < self.config.sliding_window)

    def forward(self, noise_embedding: torch.Tensor, target_hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states of the block slots; apply the target's LM head for logits.

        Args:
            noise_embedding: (B, Q, D) the target's input embedding of the block tokens,
                [anchor, mask x (block_size - 1)] per block.
            target_hidden: (B, C, n_taps * D) the target's RAW hidden states at the taps
                (`hidden_states[L + 1]` for L in `target_layer_ids`, concatenated in that order,
                not yet projected: `fc` and `hidden_norm` are applied here).
            position_ids: (B, C + Q) absolute positions of the context, then of the block slots.
            attention_mask: optional (B, Q, C + Q) bool, True = attend, keys = [context, block].
                Default: every slot sees the whole context and the whole block (one block
                whose anchor follows the context; sliding layers still apply their window).

        Returns:
            (B, Q, D) hidden states.
        """
        B, Q, _ = noise_embedding.shape
        C = target_hidden.shape[1]
        dtype = self.fc.weight.dtype
        x = noise_embedding.to(dtype)
        ctx = self.hidden_norm(self.fc(target_hidden.to(dtype)))  # (B, C, n*D) -> (B, C, D)
        k_pos, q_pos = position_ids, position_ids[:, C:]  # keys: context then block; queries: block
        theta, hd = _rope_theta(self.config), self.config.head_dim
        rope_q, rope_k = rope_cos_sin(q_pos, hd, theta, dtype), rope_cos_sin(k_pos, hd, theta, dtype)
        if attention_mask is None:
            attention_mask = torch.ones(B, Q, C + Q, dtype=torch.bool, device=x.device)
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, rope_q, rope_k, self.layer_mask(i, attention_mask, q_pos, k_pos))
        return self.norm(x)
