"""The DFlash drafter (arXiv 2602.06036): a small Qwen3-style block diffusion drafter.

Read top to bottom: config, the attention-mask rule, RoPE, the attention
backends table, the Qwen3 building blocks, then `DFlashDrafter`.

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
anchors, losses or decoding loops (see `draftflow.train`, `draftflow.evaluate`).

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

import functools
import json
import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from draftflow.config import DrafterConfig
from draftflow.errors import ConfigError, StoreError
from draftflow.layers import default_dflash_layer_ids, validate_layer_ids

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
# Prefixes of the target's modules shared into the drafter: frozen, never saved.
SHARED_PREFIXES = ("embed_tokens.", "lm_head.")
LAYER_TYPES = ("full_attention", "sliding_attention")


# ----------------------------------------------------------------------------- config


@dataclass
class DFlashConfig:
    """Drafter shape: dims copied from the target, depth and block from `DrafterConfig`."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    num_target_layers: int
    attn_backend: str = "auto"  # "auto" = flex on CUDA, sdpa elsewhere
    layer_types: list[str] | None = None  # per layer "full_attention" | "sliding_attention"
    sliding_window: int | None = None
    architecture: str = field(default="DFlashDrafter")

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_target(cls, target_config: Any, drafter: DrafterConfig, mask_token_id: int | None = None) -> DFlashConfig:
        """Build from the target's HF config and the run's `drafter` section.

        Args:
            target_config: the target's `transformers` config (Qwen3-like fields).
            drafter: `DrafterConfig`; its `mask_token_id` wins over the argument.
            mask_token_id: fallback mask id, normally `len(tokenizer)` (paper: Qwen3 151669).

        Raises:
            ConfigError: no mask id, a mask id outside the target's embedding, or bad taps.
        """
        n_layers = int(target_config.num_hidden_layers)
        if getattr(target_config, "rope_scaling", None):
            logger.warning("target rope_scaling %s is ignored: the drafter uses plain RoPE", target_config.rope_scaling)
        ids = drafter.target_layer_ids or default_dflash_layer_ids(n_layers, drafter.num_taps)
        validate_layer_ids(ids, n_layers)
        if len(ids) != drafter.num_taps:
            raise ConfigError(
                f"drafter.target_layer_ids has {len(ids)} ids but drafter.num_taps is "
                f"{drafter.num_taps}; make them agree"
            )
        mask_id = drafter.mask_token_id if drafter.mask_token_id is not None else mask_token_id
        if mask_id is None:
            raise ConfigError("no mask token id: set drafter.mask_token_id or pass len(tokenizer)")
        heads = int(target_config.num_attention_heads)
        head_dim = getattr(target_config, "head_dim", None) or target_config.hidden_size // heads
        cfg = cls(
            hidden_size=int(target_config.hidden_size),
            num_layers=drafter.num_layers,
            num_heads=heads,
            num_kv_heads=int(getattr(target_config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            intermediate_size=int(target_config.intermediate_size),
            rms_norm_eps=float(target_config.rms_norm_eps),
            rope_theta=float(getattr(target_config, "rope_theta", 10000.0)),
            vocab_size=int(target_config.vocab_size),
            block_size=drafter.block_size,
            target_layer_ids=list(ids),
            mask_token_id=int(mask_id),
            num_target_layers=n_layers,
            attn_backend=drafter.attn_backend,
            layer_types=list(drafter.layer_types) if drafter.layer_types else None,
            sliding_window=drafter.sliding_window,
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise ConfigError when the fields cannot make a drafter."""
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"drafter.mask_token_id={self.mask_token_id} is outside the target's embedding "
                f"({self.vocab_size} rows); pick an id < {self.vocab_size} or resize the target"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} not a multiple of {self.num_kv_heads}")
        if self.block_size < 2:
            raise ConfigError(f"drafter.block_size must be >= 2, got {self.block_size}")
        if self.attn_backend != "auto" and self.attn_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"drafter.attn_backend {self.attn_backend!r} unknown; choose auto or one of "
                f"{sorted(ATTENTION_BACKENDS)}"
            )
        self._validate_layer_types()

    def _validate_layer_types(self) -> None:
        types = self.layer_types or []
        if self.layer_types is not None and len(types) != self.num_layers:
            raise ConfigError(
                f"drafter.layer_types has {len(types)} entries but drafter.num_layers is {self.num_layers}"
            )
        bad = sorted(set(types) - set(LAYER_TYPES))
        if bad:
            raise ConfigError(f"drafter.layer_types has unknown {bad}; use {list(LAYER_TYPES)}")
        if "sliding_attention" in types and not (self.sliding_window or 0) >= 1:
            raise ConfigError("drafter.layer_types has sliding_attention layers: set drafter.sliding_window >= 1")

    def layer_type(self, i: int) -> str:
        """Attention kind of layer i ("full_attention" when `layer_types` is unset)."""
        return self.layer_types[i] if self.layer_types else "full_attention"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DFlashConfig:
        """Inverse of `to_dict`; unknown keys are an error, not ignored."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"DFlash config has unknown keys {unknown}; was it written by draftflow?")
        cfg = cls(**data)
        cfg.target_layer_ids = list(cfg.target_layer_ids)
        cfg.layer_types = list(cfg.layer_types) if cfg.layer_types else None
        cfg.validate()
        return cfg


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

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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


# ----------------------------------------------------------------------------- the drafter


class DFlashDrafter(nn.Module):
    """DFlash drafter sharing the target's (frozen) embedding and LM head.

    Args:
        cfg: the drafter's shape.
        target_model: the HF causal LM; its input embedding and output head are
            borrowed (same modules, not copies) and set to requires_grad=False.
            So `drafter.to(device)` moves them too; cast the drafter with care.

    Raises:
        ConfigError: the mask id has no embedding row, or the widths disagree.
    """

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
    ) -> torch.Tensor:
        """Logits for every block slot.

        Args:
            block_ids: (B, Q) tokens: per block [anchor, mask x (B-1)].
            block_pos: (B, Q) absolute positions of those tokens.
            ctx_hidden: (B, C, n_taps*D) target features, taps concatenated in tap order.
            ctx_pos: (B, C) absolute positions of the context features.
            attn_mask: (B, Q, C+Q) bool, keys = [context, block slots]; see
                `block_attention_mask`.

        Returns:
            (B, Q, V) logits from the target's LM head.
        """
        h = self.forward_hidden(block_ids, block_pos, ctx_hidden, ctx_pos, attn_mask)
        return self.lm_head(h.to(self.lm_head.weight.dtype))

    # ------------------------------------------------------------------ bookkeeping

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Every drafter weight except the shared embedding and LM head."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(SHARED_PREFIXES)}

    def param_counts(self) -> tuple[int, int]:
        """(trainable, frozen) parameter counts; frozen = the shared target modules."""
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in self.parameters() if not p.requires_grad)
        return trainable, frozen

    def save(self, out_dir: str | Path) -> None:
        """Write `model.safetensors` (trainable weights only) and `config.json` to a local dir."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.trainable_state_dict().items()}
        _atomic(out / WEIGHTS_NAME, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
        text = json.dumps(self.config.to_dict(), indent=2, sort_keys=True)
        _atomic(out / CONFIG_NAME, lambda p: Path(p).write_text(text))

    @classmethod
    def load(cls, in_dir: str | Path, target_model: nn.Module) -> DFlashDrafter:
        """Rebuild a saved drafter around `target_model`'s embedding and head.

        Raises:
            StoreError: files missing, or weights that do not match the config exactly.
        """
        folder = Path(in_dir)
        if not (folder / CONFIG_NAME).is_file() or not (folder / WEIGHTS_NAME).is_file():
            raise StoreError(f"{folder} has no {CONFIG_NAME} + {WEIGHTS_NAME}; train a drafter first")
        cfg = DFlashConfig.from_dict(json.loads((folder / CONFIG_NAME).read_text()))
        model = cls(cfg, target_model)
        weights = load_file(str(folder / WEIGHTS_NAME))
        expected = set(model.trainable_state_dict())
        if set(weights) != expected:
            raise StoreError(
                f"{folder / WEIGHTS_NAME} does not match its config: missing "
                f"{sorted(expected - set(weights))[:5]}, unexpected {sorted(set(weights) - expected)[:5]}"
            )
        model.load_state_dict(weights, strict=False)
        return model.to(target_model.get_input_embeddings().weight.device)


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


def _atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """Write through a temporary name, then rename over `path`."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)
