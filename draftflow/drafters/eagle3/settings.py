"""EAGLE-3's own settings: the fields of the `drafter` section only this kind reads (its unroll and its draft
vocabulary). Plain pydantic, loaded by the config by the kind's name (see `draftflow/drafters/dflash/settings.py`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from draftflow.config.fields import Section


class Eagle3Settings(Section):
    num_layers: int = Field(1, ge=1, description="decoder layers: the paper's one (the first reads [embedding, "
                            "hidden]), or more plain Llama layers after it (vLLM serves them)")
    draft_vocab_size: int = Field(32000, ge=1, description="the draft vocabulary: the N most frequent supervised "
                                  "tokens (counted by tokenize, chosen by train)")
    ttt_steps: int = Field(7, ge=1, description="training-time-test unroll steps = drafts per round")
    ttt_decay: float = Field(0.8, gt=0.0, le=1.0, description="loss weight of unroll step i is decay^i")
    draftable: Literal["target", "tokens"] | None = Field(
        None, description="the positions the loss scores: where the target's argmax over its whole vocabulary is a "
        "draft token (target: the paper; one pass of the target's whole LM head per training sequence) or where the "
        "sequence's next token is one (tokens: the same positions for greedy regenerations, no pass of the whole "
        "head); null = train.recipe's (paper: target, draftflow: tokens)")


SETTINGS = Eagle3Settings
