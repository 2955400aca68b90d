"""The DFlash drafter (arXiv 2602.06036): a small Qwen3-style block diffusion drafter.

Read top to bottom: DFlash's attention and decoder layer, then `DFlashDrafter`. The
Qwen3 building blocks (RoPE, RMSNorm, MLP), weight I/O, the mask rule and attention backends are
shared (`draftflow/models/`: blocks.py, weights.py, attention.py); the config is this folder's `config.py`.

What DFlash changes relative to a Qwen3 decoder (each marked `# DFlash:`):
  * Input is a *block* [anchor token, mask x (B-1)] drafted in one forward pass,
    attending bidirectionally inside the block (no causal mask).
  * Target features from a few tapped layers are concatenated, projected by
    `fc` (n_taps*D -> D, no bias) and RMS-normed (`hidden_norm`), then enter
    every draft layer as extra keys/values only, never as queries.
  * The target's token embedding and LM head are shared and frozen: they are
    registered here for a readable forward pass but never trained or saved.

What it does not know: how the features were captured (the caller passes
them, tap i = DFlash layer id `target_layer_ids[i]`, see `draftflow.layers`),
anchors, losses or decoding loops (see `draftflow.training`, `draftflow.evaluation.decode`).

Key trade-off: callers pass one explicit boolean mask (B, Q, C+Q) built by
`block_attention_mask`, which is simple, exact and runs on CPU, but costs
O(Q*(C+Q)) memory. Backends come from `ATTENTION_BACKENDS`: "sdpa" uses that
mask directly; "flex" (flex_attention, compiled on CUDA) turns the same mask
into a block-sparse `BlockMask` once per forward, so the rule has one
definition. Sliding-window layers (`layer_types`) narrow that mask by
positions (`sliding_window_mask`). Parameter names follow HF Qwen3 (`layers.0.self_attn.q_proj`)
so export to other runtimes is a rename table.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from draftflow.drafters.dflash.config import DFlashConfig
from draftflow.drafters.dflash.mask import sliding_window_mask
from draftflow.errors import ConfigError
from draftflow.models.attention import ATTENTION_BACKENDS, MASK_PREPARERS, AttentionFn, resolve_backend
from draftflow.models.blocks import MLP, RMSNorm, apply_rope, rope_cos_sin
from draftflow.models.weights import SharedTargetDrafter, load_exact, read_weights_and_config

logger = logging.getLogger(__name__)

# Prefixes of the target's modules shared into the drafter: frozen, never saved.
SHARED_PREFIXES = ("embed_tokens.", "lm_head.")


class Attention(nn.Module):
    """Qwen3 GQA attention whose keys/values also cover the projected context features."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.n_head, self.n_kv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)  # per head, as in Qwen3
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_k, mask, attn_fn: AttentionFn):
        """x (B, Q, D) block states; ctx (B, C, D) context; mask for keys (C+Q) -> (B, Q, D)."""
        B, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, Q, self.n_head, self.hd)).transpose(1, 2)
        kv_in = torch.cat([ctx, x], dim=1)  # DFlash: context features are keys/values only
        K = kv_in.shape[1]  # C + Q
        k = self.k_norm(self.k_proj(kv_in).view(B, K, self.n_kv, self.hd)).transpose(1, 2)
        v = self.v_proj(kv_in).view(B, K, self.n_kv, self.hd).transpose(1, 2)  # (B, Hkv, K, hd)
        q = apply_rope(q, *rope_q)  # block queries at their absolute positions
        k = apply_rope(k, *rope_k)  # context keys at theirs, then block keys
        y = attn_fn(q, k, v, mask, self.scale)  # (B, H, Q, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, Q, self.n_head * self.hd))

    def project_kv(self, h, rope):
        """Rotated keys and values of states h (B, L, D) at the positions of `rope` -> each (B, Hkv, L, hd)."""
        B, L, _ = h.shape
        k = self.k_norm(self.k_proj(h).view(B, L, self.n_kv, self.hd)).transpose(1, 2)
        v = self.v_proj(h).view(B, L, self.n_kv, self.hd).transpose(1, 2)
        return apply_rope(k, *rope), v

    def forward_cached(self, x, ctx_kv, rope_q, mask, attn_fn: AttentionFn):
        """`forward` with the context's keys/values precomputed by `project_kv` (a decoding cache)."""
        B, Q, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).view(B, Q, self.n_head, self.hd)).transpose(1, 2), *rope_q)
        k, v = self.project_kv(x, rope_q)  # block keys at the block's own positions
        k, v = torch.cat([ctx_kv[0], k], dim=2), torch.cat([ctx_kv[1], v], dim=2)  # (B, Hkv, C+Q, hd)
        y = attn_fn(q, k, v, mask, self.scale)
        return self.o_proj(y.transpose(1, 2).reshape(B, Q, self.n_head * self.hd))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, ctx, rope_q, rope_k, mask, attn_fn):
        # DFlash: ctx is already normed by `hidden_norm`, so only the block goes through
        # input_layernorm; the same ctx enters every layer.
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_k, mask, attn_fn)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_cached(self, x, ctx_kv, rope_q, mask, attn_fn):
        x = x + self.self_attn.forward_cached(self.input_layernorm(x), ctx_kv, rope_q, mask, attn_fn)
        return x + self.mlp(self.post_attention_layernorm(x))


# ----------------------------------------------------------------------------- the drafter


class DFlashDrafter(SharedTargetDrafter):
    """DFlash drafter sharing the target's (frozen) embedding and LM head.

    Args:
        cfg: the drafter's shape.
        target_model: the HF causal LM; its input embedding and output head are
            borrowed (same modules, not copies) and set to requires_grad=False.
            So `drafter.to(device)` moves them too; cast the drafter with care.

    Raises:
        ConfigError: the mask id has no embedding row, or the widths disagree.
    """

    shared_prefixes = SHARED_PREFIXES

    def __init__(self, cfg: DFlashConfig, target_model: nn.Module):
        super().__init__()
        cfg.validate()
        self.config = cfg
        embed, head = target_model.get_input_embeddings(), target_model.get_output_embeddings()
        _check_shared(cfg, embed, head)
        # DFlash: embedding and LM head are the target's, shared and frozen (never saved).
        self.embed_tokens = embed.requires_grad_(False)
        self.lm_head = head.requires_grad_(False)
        D = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_taps * D, D, bias=False)  # DFlash: fuse tapped layers
        self.hidden_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        # Initialise only the drafter's own linears: the shared target modules are untouched.
        for module in [self.fc, *self.layers.modules()]:
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)  # HF initializer_range

    def forward_hidden(self, block_ids, block_pos, ctx_hidden, ctx_pos, attn_mask):
        """Final-normed block states (B, Q, D); see `forward` for the arguments."""
        dtype = self.fc.weight.dtype
        x = self.embed_tokens(block_ids).to(dtype)  # (B, Q, D)
        ctx = self.hidden_norm(self.fc(ctx_hidden.to(dtype)))  # (B, C, n_taps*D) -> (B, C, D)
        cfg = self.config
        rope_q = rope_cos_sin(block_pos, cfg.head_dim, cfg.rope_theta, dtype)  # (B, 1, Q, hd)
        key_pos = torch.cat([ctx_pos, block_pos], dim=1)  # (B, C+Q)
        rope_k = rope_cos_sin(key_pos, cfg.head_dim, cfg.rope_theta, dtype)
        backend = resolve_backend(cfg.attn_backend, x.device)
        masks = self._layer_masks(attn_mask, block_pos, key_pos, MASK_PREPARERS[backend])
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, rope_q, rope_k, masks[cfg.layer_type(i)], ATTENTION_BACKENDS[backend])
        return self.norm(x)

    def context_kv(self, ctx_hidden: torch.Tensor, ctx_pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's keys/values of the projected context features: what a decoding loop caches.

        A context position is never a query, so its keys/values depend on its own features and
        position only: computed once when the position is accepted, appended, never recomputed.

        Args:
            ctx_hidden: (B, C, n_taps*D) target features; ctx_pos: (B, C) their absolute positions.

        Returns:
            Per layer (k, v), each (B, Hkv, C, hd), keys rotated to `ctx_pos`.
        """
        dtype = self.fc.weight.dtype
        ctx = self.hidden_norm(self.fc(ctx_hidden.to(dtype)))  # (B, C, D)
        rope_k = rope_cos_sin(ctx_pos, self.config.head_dim, self.config.rope_theta, dtype)
        return [layer.self_attn.project_kv(ctx, rope_k) for layer in self.layers]

    def forward_cached(self, block_ids, block_pos, ctx_kv, ctx_pos, attn_mask) -> torch.Tensor:
        """`forward` with the context given as `context_kv`'s keys/values: the same logits up to float
        rounding, at a cost independent of the context's features (attention still reads all C keys)."""
        dtype = self.fc.weight.dtype
        x = self.embed_tokens(block_ids).to(dtype)  # (B, Q, D)
        cfg = self.config
        rope_q = rope_cos_sin(block_pos, cfg.head_dim, cfg.rope_theta, dtype)
        key_pos = torch.cat([ctx_pos, block_pos], dim=1)  # (B, C+Q)
        backend = resolve_backend(cfg.attn_backend, x.device)
        masks = self._layer_masks(attn_mask, block_pos, key_pos, MASK_PREPARERS[backend])
        for i, (layer, kv) in enumerate(zip(self.layers, ctx_kv, strict=True)):
            x = layer.forward_cached(x, kv, rope_q, masks[cfg.layer_type(i)], ATTENTION_BACKENDS[backend])
        return self.lm_head(self.norm(x).to(self.lm_head.weight.dtype))

    def _layer_masks(self, attn_mask, block_pos, key_pos, prepare) -> dict[str, Any]:
        """The full mask and, when some layer slides, its sliding-window narrowing."""
        masks = {"full_attention": prepare(attn_mask)}
        if "sliding_attention" in (self.config.layer_types or []):
            window = self.config.sliding_window
            masks["sliding_attention"] = prepare(sliding_window_mask(attn_mask, block_pos, key_pos, window))
        return masks

    def forward(
        self,
        block_ids: torch.Tensor,
        block_pos: torch.Tensor,
        ctx_hidden: torch.Tensor,
        ctx_pos: torch.Tensor,
        attn_mask: torch.Tensor,
        vocab: torch.Tensor | None = None,
        vocab_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits for every block slot.

        Args:
            block_ids: (B, Q) tokens: per block [anchor, mask x (B-1)].
            block_pos: (B, Q) absolute positions of those tokens.
            ctx_hidden: (B, C, n_taps*D) target features, taps concatenated in tap order.
            ctx_pos: (B, C) absolute positions of the context features.
            attn_mask: (B, Q, C+Q) bool, keys = [context, block slots]; see
                `block_attention_mask`.
            vocab, vocab_bias: score only these LM-head rows (`batches.sampled_vocab`); None = all.

        Returns:
            (B, Q, V) logits from the target's LM head; with `vocab` (K,) token ids, (B, Q, K) logits of
            those rows only, plus `vocab_bias` (training's sampled softmax: the head is most of a CPU step).
        """
        h = self.forward_hidden(block_ids, block_pos, ctx_hidden, ctx_pos, attn_mask).to(self.lm_head.weight.dtype)
        if vocab is None:
            return self.lm_head(h)
        return F.linear(h, self.lm_head.weight[vocab]) + vocab_bias.to(h.dtype)

    @classmethod
    def load(cls, in_dir: str | Path, target_model: nn.Module) -> DFlashDrafter:
        """Rebuild a saved drafter around `target_model`'s embedding and head.

        Raises:
            StoreError: files missing, or weights that do not match the config exactly.
        """
        config, weights = read_weights_and_config(in_dir)
        return load_exact(cls(DFlashConfig.from_dict(config), target_model), weights, in_dir)


def _check_shared(cfg: DFlashConfig, embed: nn.Module, head: nn.Module | None) -> None:
    rows, width = embed.weight.shape
    if cfg.mask_token_id >= rows:
        raise ConfigError(
            f"drafter.mask_token_id={cfg.mask_token_id} but the target's embedding has only "
            f"{rows} rows; resize the target's embeddings or set an id < {rows}"
        )
    if width != cfg.hidden_size or head is None or head.weight.shape[1] != cfg.hidden_size:
        raise ConfigError(
            f"target embedding/LM head width {width} does not match drafter hidden_size "
            f"{cfg.hidden_size}; build the DFlashConfig from this target's config"
        )
