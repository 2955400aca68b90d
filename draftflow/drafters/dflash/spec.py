"""The DFlash kind's spec (arXiv 2602.06036): block drafting from injected tap features.

It wires this folder's parts (data rule, config, model, objective, exporters) and adds the block
proposer evaluate uses (`draft_block`, and `CachedBlockProposer` with a KV cache of the context) and
the train cost model.
"""

from __future__ import annotations

from typing import Any

import torch

from draftflow.config import DrafterConfig, RunConfig
from draftflow.drafters.dflash.batches import make_block_batch
from draftflow.drafters.dflash.config import DFlashConfig
from draftflow.drafters.dflash.export import export_files, export_speculators, export_vllm_dflash, load_exported_dflash
from draftflow.drafters.dflash.mask import block_attention_mask
from draftflow.drafters.dflash.model import DFlashDrafter
from draftflow.drafters.dflash.objective import DFlashObjective
from draftflow.drafters.dflash.taps import RULE
from draftflow.drafters.spec import DrafterSpec, DraftInputs


def config_from_target(target_config: Any, drafter: DrafterConfig, inputs: DraftInputs) -> DFlashConfig:
    return DFlashConfig.from_target(target_config, drafter, inputs.mask_token_id)


def build(dcfg: DFlashConfig, target_model, draft_vocab=None) -> DFlashDrafter:
    return DFlashDrafter(dcfg, target_model)


def _block(drafter: DFlashDrafter, anchor: int, C: int) -> tuple[torch.Tensor, ...]:
    """block_ids, block_pos, ctx_pos and mask of the block [anchor, mask x (B-1)] placed at position C."""
    cfg, device = drafter.config, drafter.fc.weight.device
    block_ids = torch.full((1, cfg.block_size), cfg.mask_token_id, dtype=torch.long, device=device)
    block_ids[0, 0] = anchor
    block_pos = torch.arange(C, C + cfg.block_size, device=device)[None]
    ctx_pos = torch.arange(C, device=device)[None]
    mask = block_attention_mask(torch.tensor([C], device=device), cfg.block_size, C)[None]
    return block_ids, block_pos, ctx_pos, mask


@torch.no_grad()
def draft_block(drafter: DFlashDrafter, anchor: int, ctx: torch.Tensor) -> torch.Tensor:
    """Drafter logits (B, V) for the block [anchor, mask x (B-1)] placed at position C.

    Args:
        anchor: the token at position C (the target's latest greedy token).
        ctx: (C, n_taps * D) tap features of positions 0..C-1 (strictly before the anchor).
    """
    block_ids, block_pos, ctx_pos, mask = _block(drafter, anchor, ctx.shape[0])
    return drafter(block_ids, block_pos, ctx[None].to(block_ids.device), ctx_pos, mask)[0]


@torch.no_grad()
def slot_drafts(drafter: DFlashDrafter, sample, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(position of every slot, its greedy draft) of the blocks at `anchors` of a known sequence (`FeatureSample`),
    drafted in one batched pass as training sees them (`make_block_batch`)."""
    b = make_block_batch(sample, anchors, drafter.config.block_size, drafter.config.mask_token_id)
    b = b.to(drafter.fc.weight.device)
    draft = drafter(b.block_ids, b.block_pos, b.ctx_hidden, b.ctx_pos, b.attn_mask)[0].argmax(-1).cpu()
    return b.block_pos[0].cpu(), draft


def propose(drafter: DFlashDrafter, seq: list[int], anchor: int, ctx: torch.Tensor) -> list[int]:
    """Greedy drafts of slots 1..B-1 of the block anchored at len(seq)."""
    return draft_block(drafter, anchor, ctx)[1:].argmax(-1).tolist()


class CachedBlockProposer:
    """`propose` with the projected context's keys/values cached (`DFlashDrafter.context_kv`).

    Only positions the target has accepted ever reach the drafter's context, so the cache only
    grows: each step projects the newly accepted positions' features and appends them; rejected
    drafts need no rollback here (the target's own cache is cropped by the decoding loop).
    """

    def __init__(self, drafter: DFlashDrafter):
        self.drafter = drafter
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer (1, Hkv, C, hd)
        self.length = 0  # C: context positions cached

    def propose(self, seq: list[int], anchor: int, new_feats: torch.Tensor) -> list[int]:
        return self.block_logits(seq, anchor, new_feats)[1:].argmax(-1).tolist()

    @torch.no_grad()
    def block_logits(self, seq: list[int], anchor: int, new_feats: torch.Tensor) -> torch.Tensor:
        """`draft_block`'s logits (B, V) after appending `new_feats` (the rows up to len(seq)) to the cache."""
        d, m = self.drafter, new_feats.shape[0]
        device = d.fc.weight.device
        pos = torch.arange(self.length, self.length + m, device=device)[None]
        kv = d.context_kv(new_feats[None].to(device), pos)
        if self.kv is not None:
            kv = [(torch.cat([k0, k], dim=2), torch.cat([v0, v], dim=2)) for (k0, v0), (k, v) in zip(self.kv, kv)]
        self.kv, self.length = kv, self.length + m
        assert self.length == len(seq), (self.length, len(seq))
        block_ids, block_pos, ctx_pos, mask = _block(d, anchor, self.length)
        return d.forward_cached(block_ids, block_pos, self.kv, ctx_pos, mask)[0]


def drafts_per_step(drafter) -> int:
    return drafter.block_size - 1  # slot 0 holds the anchor


def train_flops(cfg: RunConfig, T: float, shape: dict[str, Any]) -> float:
    """6 x drafter params x (block + context tokens) + 4 x LM head x block tokens."""
    Q = min(cfg.train.num_anchors, T) * cfg.drafter.block_size
    return 6 * cfg.drafter.num_layers * shape["layer_params"] * (Q + T) + 4 * shape["head_params"] * Q


SPEC = DrafterSpec(
    kind="dflash",
    title="DFlash",
    architecture="DFlashDrafter",
    model=DFlashDrafter,
    rule=RULE,
    mask_token=True,
    draft_vocab=None,
    config_from_target=config_from_target,
    build=build,
    objective=DFlashObjective,
    propose=propose,
    cached_proposer=CachedBlockProposer,
    drafts_per_step=drafts_per_step,
    exporters={"vllm": export_vllm_dflash, "speculators": export_speculators},
    export_files=export_files,
    owns_export=lambda c: c.get("speculators_model_type") == "dflash" or "DFlashDraftModel" in c.get(
        "architectures", []),
    load_export=load_exported_dflash,
    train_flops=train_flops,
    cost_note="DFlash: 6 x drafter params x (anchors x block + context) + 4 x LM head x block tokens",
    drafting=lambda d: f"block size {d.block_size}",
    block_logits=draft_block,
    slot_drafts=slot_drafts,
)
