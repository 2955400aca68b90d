"""`DrafterSpec`: everything the pipeline needs to know about one drafter kind, in one frozen record.

A spec is data plus small functions; the stages, training, evaluation, exports and the plan look
a kind up (`draftflow.drafters.registry.drafter_spec`) instead of branching on `drafter.kind`. What it
deliberately does not know: stores, manifests, Prefect. Trade-off: fields are plain callables
rather than methods of a subclass per kind, so a spec reads as one table and needs no base class.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from draftflow.config import DrafterConfig, RunConfig, TrainConfig
from draftflow.drafters.rule import DataRule


@dataclass(frozen=True)
class DraftInputs:
    """What training knows beyond the target's config when it builds a drafter config."""

    mask_token_id: int | None = None  # the tokenizer's mask token, else len(tokenizer) (DFlash)
    draft_vocab_size: int | None = None  # rows of the chosen draft vocabulary (EAGLE-3)


class CachedProposer(Protocol):
    """One prompt's drafting state kept across decoding steps (a KV cache of the drafter's context)."""

    def propose(self, seq: list[int], anchor: int, new_feats: Any) -> list[int]:
        """The drafts `DrafterSpec.propose(drafter, seq, anchor, ctx)` makes, where `new_feats` holds only the
        rows of ctx this proposer has not seen yet (positions from its previous `len(seq)` to `len(seq) - 1`)."""
        ...


@dataclass(frozen=True)
class DrafterSpec:
    """One drafter kind (`drafter.kind`).

    Attributes:
        kind: the `drafter.kind` value; title: its name in reports and export READMEs.
        architecture: the `architecture` a checkpoint's config.json records (chooses `model` on load).
        model: the drafter module class; `model.load(folder, target_model)` loads a checkpoint.
        rule: the kind's data rule (taps, checks, minimum supervised tokens: its light `taps.py`).
        mask_token: the kind fills draft slots with a mask token (training finds one unless
            `drafter.mask_token_id` is set: `DraftInputs.mask_token_id`).
        draft_vocab: (token counts, target vocabulary size, size) -> (d2t, t2d) for a kind that drafts over
            its own vocabulary (training chooses it from tokenize's counts); None: the target's.
        config_from_target: (target HF config, drafter section, DraftInputs) -> the drafter config.
        build: (drafter config, target model, draft vocab (d2t, t2d) or None) -> a fresh drafter.
        objective: (drafter config, train section, the run's drafter section or None) -> the training objective
            (the section: for a kind whose loss reads a setting of its own, `drafter.own(<kind>.settings.SETTINGS)`).
        propose: (drafter, seq, anchor, ctx features) -> greedy drafts (evaluate).
        cached_proposer: (drafter) -> a fresh `CachedProposer` for one prompt (evaluate with
            `evaluate.kv_cache`): the same drafts as `propose`, from cached drafter state.
        drafts_per_step: (drafter section or drafter config) -> most drafts one step can accept
            (= vLLM's `num_speculative_tokens`).
        exporters: per export format ("vllm", "speculators"), the function writing that folder.
        export_files: format -> the files an export folder holds.
        owns_export: (an export's config.json) -> whether this kind wrote it (either format).
        load_export: (folder, its config.json, target model) -> the drafter, loaded back.
        train_flops: (run config, mean sequence length T, target shape of `estimate.model_shape`)
            -> FLOPs to train on one sequence (the drafter's part; the plan adds online extraction).
        cost_note: the cost model in words (`draftflow plan` prints it).
        drafting: (drafter section) -> how the kind drafts, for the evaluation report.
        block_logits: (drafter, anchor, ctx features) -> (drafts + 1, V) logits of every draft slot from one
            drafting pass, for a kind that proposes trees (evaluate's DDTree); None: it drafts token by token.
        slot_drafts: (drafter, FeatureSample, anchors) -> (slot positions, greedy drafts) of one batched pass at
            many anchors of a known sequence, slot k of each block at position anchor + k (evaluate's alignment
            check); None: the kind has no slots to align.
    """

    kind: str
    title: str
    architecture: str
    model: type
    rule: DataRule
    mask_token: bool
    draft_vocab: Callable[[Counter, int, int], tuple[list[int], list[bool]]] | None
    config_from_target: Callable[[Any, DrafterConfig, DraftInputs], Any]
    build: Callable[..., Any]
    objective: Callable[[Any, TrainConfig, DrafterConfig | None], Any]
    propose: Callable[..., list[int]]
    cached_proposer: Callable[[Any], CachedProposer]
    drafts_per_step: Callable[[Any], int]
    exporters: Mapping[str, Callable[..., Any]]
    export_files: Callable[[str], tuple[str, ...]]
    owns_export: Callable[[dict[str, Any]], bool]
    load_export: Callable[[Path, dict[str, Any], Any], Any]
    train_flops: Callable[[RunConfig, float, dict[str, Any]], float]
    cost_note: str
    drafting: Callable[[DrafterConfig], str]
    block_logits: Callable[..., Any] | None = None
    slot_drafts: Callable[..., tuple[Any, Any]] | None = None
