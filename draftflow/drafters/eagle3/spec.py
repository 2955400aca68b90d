"""The EAGLE-3 kind's spec (arXiv 2503.01840): three fused taps, its decoder layers, training-time-test unroll.

It wires this folder's parts (data rule, config, model and chain drafting, objective, exporters, the
draft vocabulary) and adds `CachedChainProposer` (the same chain from a KV cache of the target's rows)
and the train cost model. Feature shards also hold the target's final normed state (soft targets);
training chooses a draft vocabulary from tokenize's counts (`vocab.py`).
"""

from __future__ import annotations

from typing import Any

import torch

from draftflow.config import DrafterConfig, RunConfig
from draftflow.drafters.eagle3.config import Eagle3Config
from draftflow.drafters.eagle3.export import export_eagle3_speculators, export_eagle3_vllm, load_exported_eagle3
from draftflow.drafters.eagle3.model import Eagle3Drafter, draft_chain
from draftflow.drafters.eagle3.objective import Eagle3Objective
from draftflow.drafters.eagle3.taps import RULE
from draftflow.drafters.eagle3.vocab import draft_vocab
from draftflow.drafters.export import EXPORT_FILES
from draftflow.drafters.spec import DrafterSpec, DraftInputs
from draftflow.errors import ConfigError


def config_from_target(target_config: Any, drafter: DrafterConfig, inputs: DraftInputs) -> Eagle3Config:
    return Eagle3Config.from_target(target_config, drafter, inputs.draft_vocab_size)


def build(dcfg: Eagle3Config, target_model, draft_vocab=None) -> Eagle3Drafter:
    if draft_vocab is None:
        raise ConfigError("an EAGLE-3 drafter needs the draft vocabulary (d2t, t2d) of the tokenize stage")
    return Eagle3Drafter(dcfg, target_model, *draft_vocab)


def propose(drafter: Eagle3Drafter, seq: list[int], anchor: int, ctx: torch.Tensor) -> list[int]:
    """A chain of `ttt_steps` greedy drafts; row p pairs h_p with token p+1."""
    return draft_chain(drafter, ctx, seq[1:] + [anchor], drafter.config.ttt_steps)[0]


class CachedChainProposer:
    """`propose` (`draft_chain`) with the keys/values of the target's rows cached.

    Row p pairs the target's taps h_p with token p+1 at position p; its keys/values (at every
    layer) depend on rows <= p alone, which never change, so a row is computed once, when the
    target has read position p and produced token p+1, and kept. Only the newest rows are
    queried. The chain's own rows (a draft's output hidden with its token) are speculative and
    live for one step. A row's query sees every row up to itself (`draft_chain`'s causal mask).
    """

    def __init__(self, drafter: Eagle3Drafter):
        self.drafter = drafter
        self.kv: tuple[torch.Tensor, ...] | None = None  # (1, Hkv, rows, hd), k and v of each layer
        self.length = 0  # rows cached = positions the target has read

    def _rows(self, ids: torch.Tensor, hidden: torch.Tensor, start: int, past: list) -> tuple[torch.Tensor, tuple]:
        """Layer outputs (m, D) and keys/values of m rows at positions start.. after the `past` rows."""
        m, c = ids.numel(), sum(kv[0].shape[2] for kv in past)
        pos = torch.arange(start, start + m, device=ids.device)
        mask = torch.arange(c + m, device=ids.device)[None, :] <= c + torch.arange(m, device=ids.device)[:, None]
        h, kv = self.drafter.step(ids[None], hidden[None], pos[None], past, mask[None])
        return h[0], kv

    def propose(self, seq: list[int], anchor: int, new_feats: torch.Tensor) -> list[int]:
        return self.chain(seq, anchor, new_feats)[0]

    @torch.no_grad()
    def chain(self, seq: list[int], anchor: int, new_feats: torch.Tensor) -> tuple[list[int], list[torch.Tensor]]:
        """`draft_chain`'s drafts and logits after appending the rows of `new_feats` (up to len(seq)) to the cache."""
        d, n = self.drafter, len(seq)
        device = d.fc.weight.device
        ids = torch.tensor((seq + [anchor])[self.length + 1 : n + 1], dtype=torch.long, device=device)
        assert ids.numel() == new_feats.shape[0], (ids.numel(), new_feats.shape)
        hidden = d.fc(new_feats.to(device, d.fc.weight.dtype))  # (m, D) the new target rows
        h, kv = self._rows(ids, hidden, self.length, [self.kv] if self.kv else [])
        if self.kv:
            kv = tuple(torch.cat([old, new], dim=2) for old, new in zip(self.kv, kv, strict=True))
        self.kv, self.length = kv, n
        past, g, drafts, logits = [self.kv], h[-1:], [], []  # g: the newest row's output hidden
        for j in range(d.config.ttt_steps):
            logits.append(d.logits(g[-1]))
            drafts.append(int(d.draft_to_target(logits[-1].argmax()[None])))
            if j + 1 < d.config.ttt_steps:  # draft j+1: this draft's hidden with its token, one position on
                g, kv = self._rows(ids.new_tensor([drafts[-1]]), g, n + j, past)
                past = past + [kv]
        return drafts, logits


def drafts_per_step(drafter) -> int:
    return drafter.ttt_steps


def train_flops(cfg: RunConfig, T: float, shape: dict[str, Any]) -> float:
    """Per unroll step over T rows: 6 x (the layers + fc 3D x D + draft head) params per row, plus the
    target head's forward over T rows for the soft targets (2 x LM head x T)."""
    D, K = shape["hidden"], cfg.drafter.ttt_steps
    params = cfg.drafter.num_layers * shape["layer_params"] + 3 * D * D + cfg.drafter.draft_vocab_size * D
    return 6 * params * K * T + 2 * shape["head_params"] * T


SPEC = DrafterSpec(
    kind="eagle3",
    title="EAGLE-3",
    architecture="Eagle3Drafter",
    model=Eagle3Drafter,
    rule=RULE,
    mask_token=False,
    draft_vocab=draft_vocab,
    config_from_target=config_from_target,
    build=build,
    objective=Eagle3Objective,
    propose=propose,
    cached_proposer=CachedChainProposer,
    drafts_per_step=drafts_per_step,
    exporters={"vllm": export_eagle3_vllm, "speculators": export_eagle3_speculators},
    export_files=lambda fmt: EXPORT_FILES,
    owns_export=lambda c: c.get("speculators_model_type") == "eagle3" or "LlamaForCausalLMEagle3" in c.get(
        "architectures", []),
    load_export=load_exported_eagle3,
    train_flops=train_flops,
    cost_note="EAGLE-3: 6 x (layer + fc + draft head) params x ttt_steps x tokens + 2 x LM head x tokens "
    "(soft targets)",
    drafting=lambda d: f"EAGLE-3 chain of {d.ttt_steps} drafts per step",
)
