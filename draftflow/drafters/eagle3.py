"""The EAGLE-3 kind (arXiv 2503.01840): three fused taps, one layer, training-time-test unroll.

Its spec wires `draftflow.models.eagle3` (model, config, chain drafting), the unroll objective,
the vLLM-native and speculators exporters and the train cost model. Feature shards also hold the
target's final normed state (soft targets); training chooses a draft vocabulary from tokenize's counts.
"""

from __future__ import annotations

from typing import Any

import torch

from draftflow.config import DrafterConfig, RunConfig
from draftflow.drafters.spec import DrafterSpec, DraftInputs
from draftflow.drafters.taps import TAP_RULES
from draftflow.errors import ConfigError
from draftflow.export import EXPORT_FILES
from draftflow.export_eagle3 import export_eagle3_speculators, export_eagle3_vllm
from draftflow.models.eagle3 import Eagle3Config, Eagle3Drafter, draft_chain
from draftflow.training.objectives import Eagle3Objective


def config_from_target(target_config: Any, drafter: DrafterConfig, inputs: DraftInputs) -> Eagle3Config:
    return Eagle3Config.from_target(target_config, drafter, inputs.draft_vocab_size)


def build(dcfg: Eagle3Config, target_model, draft_vocab=None) -> Eagle3Drafter:
    if draft_vocab is None:
        raise ConfigError("an EAGLE-3 drafter needs the draft vocabulary (d2t, t2d) of the tokenize stage")
    return Eagle3Drafter(dcfg, target_model, *draft_vocab)


def propose(drafter: Eagle3Drafter, seq: list[int], anchor: int, ctx: torch.Tensor) -> list[int]:
    """A chain of `ttt_steps` greedy drafts; row p pairs h_p with token p+1."""
    return draft_chain(drafter, ctx, seq[1:] + [anchor], drafter.config.ttt_steps)[0]


def drafts_per_step(drafter) -> int:
    return drafter.ttt_steps


def train_flops(cfg: RunConfig, T: float, shape: dict[str, Any]) -> float:
    """Per unroll step over T rows: 6 x (one layer + fc 3D x D + draft head) params per row, plus the
    target head's forward over T rows for the soft targets (2 x LM head x T)."""
    D, K = shape["hidden"], cfg.drafter.ttt_steps
    params = shape["layer_params"] + 3 * D * D + cfg.drafter.draft_vocab_size * D
    return 6 * params * K * T + 2 * shape["head_params"] * T


SPEC = DrafterSpec(
    kind="eagle3",
    title="EAGLE-3",
    architecture="Eagle3Drafter",
    model=Eagle3Drafter,
    taps=TAP_RULES["eagle3"],
    draft_vocab=True,
    config_from_target=config_from_target,
    build=build,
    objective=Eagle3Objective,
    propose=propose,
    drafts_per_step=drafts_per_step,
    exporters={"vllm": export_eagle3_vllm, "speculators": export_eagle3_speculators},
    export_files=lambda fmt: EXPORT_FILES,
    vllm_method="eagle3",
    train_flops=train_flops,
    cost_note="EAGLE-3: 6 x (layer + fc + draft head) params x ttt_steps x tokens + 2 x LM head x tokens "
    "(soft targets)",
    drafting=lambda d: f"EAGLE-3 chain of {d.ttt_steps} drafts per step",
)
