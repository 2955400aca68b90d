"""EAGLE-3 drafter config: dims copied from the target's HF config, taps and unroll from the run's
`drafter` section. Validated at construction; knows nothing of modules or weights.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from draftflow.config import DrafterConfig
from draftflow.drafters.eagle3.taps import eagle3_taps
from draftflow.errors import ConfigError
from draftflow.layers import FINAL
from draftflow.models.blocks import target_dims


@dataclass
class Eagle3Config:
    """Drafter shape: dims copied from the target, taps and unroll from `DrafterConfig`."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_layer_ids: list[int]  # draftflow ids (output of layer L), low/mid/high
    num_target_layers: int
    num_layers: int = 1  # midlayer, then plain Llama layers (`model.LaterLayer`)
    ttt_steps: int = 7
    ttt_decay: float = 0.8
    distill_top_k: int | None = None  # training's labels (`ObjectiveOptions`): None the whole distribution
    acceptance_loss: bool = False  # training: the acceptance-oriented loss (`ObjectiveOptions`)
    architecture: str = field(default="Eagle3Drafter")

    @property
    def feature_ids(self) -> list[int]:
        """What a feature shard must hold, in order: the 3 taps, then the final normed state."""
        return [*self.target_layer_ids, FINAL]

    @classmethod
    def from_target(cls, target_config: Any, drafter: DrafterConfig, draft_vocab_size: int) -> Eagle3Config:
        """Build from the target's HF config, the run's `drafter` section and the draft vocabulary size.

        Raises:
            ConfigError: bad taps.
        """
        n_layers = int(target_config.num_hidden_layers)
        cfg = cls(
            **target_dims(target_config),
            draft_vocab_size=int(draft_vocab_size),
            target_layer_ids=eagle3_taps(drafter.target_layer_ids, n_layers),
            num_target_layers=n_layers,
            num_layers=drafter.num_layers,
            ttt_steps=drafter.ttt_steps,
            ttt_decay=drafter.ttt_decay,
            distill_top_k=drafter.distill_top_k,
            acceptance_loss=bool(drafter.acceptance_loss),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise ConfigError when the fields cannot make a drafter."""
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} not a multiple of {self.num_kv_heads}")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ConfigError(f"draft vocabulary of {self.draft_vocab_size} tokens for a target vocabulary of "
                              f"{self.vocab_size}; set drafter.draft_vocab_size between 1 and {self.vocab_size}")
        if self.num_layers < 1:
            raise ConfigError(f"an EAGLE-3 drafter needs at least one decoder layer, not {self.num_layers}: set "
                              "drafter.num_layers to 1 (the paper's) or more")
        if self.ttt_steps < 1 or not 0 < self.ttt_decay <= 1:
            raise ConfigError(f"drafter.ttt_steps must be >= 1 and 0 < drafter.ttt_decay <= 1, got "
                              f"{self.ttt_steps} and {self.ttt_decay}")
        eagle3_taps(self.target_layer_ids, self.num_target_layers)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Eagle3Config:
        """Inverse of `to_dict`; unknown keys are an error, not ignored."""
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"EAGLE-3 config has unknown keys {unknown}; was it written by draftflow?")
        cfg = cls(**data)
        cfg.target_layer_ids = list(cfg.target_layer_ids)
        cfg.validate()
        return cfg
