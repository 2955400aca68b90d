"""DFlash drafter config: shape from the target's HF config plus the run's `drafter` section.

Validated at construction: taps against the target's depth, the mask token
against the embedding, layer types and the attention backend by name. Knows
nothing of modules or weights.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from draftflow.compat import rope_scaling
from draftflow.config import DrafterConfig
from draftflow.drafters.dflash.taps import check_layer_types, dflash_taps
from draftflow.errors import ConfigError
from draftflow.layers import FINAL
from draftflow.models.attention import ATTENTION_BACKENDS
from draftflow.models.blocks import target_dims

logger = logging.getLogger(__name__)



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
    distill_top_k: int | None = None  # training's labels (`ObjectiveOptions`): 0/None hard, k > 0 the target's top k
    acceptance_loss: bool = False  # training: the acceptance-oriented loss (`ObjectiveOptions`)
    architecture: str = field(default="DFlashDrafter")

    @property
    def stores_final(self) -> bool:
        """Whether its features end with the target's final state (soft labels are computed from it)."""
        return bool(self.distill_top_k)

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def feature_ids(self) -> list[int]:
        """What a feature shard must hold, in order: the taps, then the final state for soft labels."""
        return list(self.target_layer_ids) + ([FINAL] if self.stores_final else [])

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
        if scaling := rope_scaling(target_config):
            logger.warning("target rope_scaling %s is ignored: the drafter uses plain RoPE", scaling)
        ids = dflash_taps(drafter.target_layer_ids, drafter.num_taps, n_layers)
        mask_id = drafter.mask_token_id if drafter.mask_token_id is not None else mask_token_id
        if mask_id is None:
            raise ConfigError("no mask token id: set drafter.mask_token_id or pass len(tokenizer)")
        cfg = cls(
            **target_dims(target_config),
            num_layers=drafter.num_layers,
            block_size=drafter.block_size,
            target_layer_ids=list(ids),
            mask_token_id=int(mask_id),
            num_target_layers=n_layers,
            attn_backend=drafter.attn_backend,
            layer_types=list(drafter.layer_types) if drafter.layer_types else None,
            sliding_window=drafter.sliding_window,
            distill_top_k=drafter.distill_top_k,
            acceptance_loss=bool(drafter.acceptance_loss),
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
        check_layer_types(self.layer_types, self.num_layers, self.sliding_window)

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
