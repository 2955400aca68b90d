"""DFlash's own settings: the fields of the `drafter` section only this kind reads (its block, taps and mask).

A kind's settings module is plain pydantic and imports nothing but the config's field types: the config
loads it by the kind's name when it validates a `drafter` section (`draftflow.config.train.kind_settings`),
so an unknown or bad field is one line naming the key, before any work. Kinds that vary DFlash (the worked
example `flat`) subclass `DFlashSettings`.
"""

from __future__ import annotations

from pydantic import Field

from draftflow.config.fields import Section


class DFlashSettings(Section):
    num_layers: int = Field(5, ge=1, description="decoder layers (the paper: 5 for Qwen3-8B)")
    block_size: int = Field(16, ge=2, description="slots per draft block (the anchor + block_size - 1 drafts)")
    num_taps: int = Field(5, ge=1, description="target layers fused; null target_layer_ids = the paper's spread")
    mask_token_id: int | None = Field(None, description="null = len(tokenizer)")
    layer_types: list[str] | None = Field(
        None, description="per layer full_attention | sliding_attention; null = all full"
    )
    sliding_window: int | None = Field(None, ge=1, description="window of sliding_attention layers")


SETTINGS = DFlashSettings
