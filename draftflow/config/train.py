"""The `drafter` and `train` config sections, and the recipes that fill what they leave unset.

A recipe (`train.recipe`) names a set of defaults, not a code path: `paper` is the papers' recipe exactly
(DFlash arXiv 2602.06036, EAGLE-3 arXiv 2503.01840: hard labels for DFlash, fixed steps, the last checkpoint),
`draftflow` adds the target's layers as the start, held-out acceptance while training and the best checkpoint,
and the objective options the ablation chose (`RECIPE_OBJECTIVE`). Any setting written out wins over its
recipe. Kept apart from `draftflow.config`, which re-exports both sections, to keep each module readable.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from draftflow.config.fields import Device, Section


class DrafterConfig(Section):
    """The drafter's kind and shape. DFlash uses every field but the `ttt_*` ones; EAGLE-3 uses
    `target_layer_ids` (3 taps), `ttt_steps`, `ttt_decay` and `attn_backend`, always has one
    decoder layer (`num_layers` must be left unset or 1) and ignores `num_taps`."""

    kind: str = Field("dflash", description="drafter algorithm: a kind of the drafter registry "
                      "(`draftflow.drafters`: dflash, eagle3), checked at preflight")
    num_layers: int = Field(5, ge=1)
    block_size: int = Field(16, ge=2)
    num_taps: int = Field(5, ge=1)
    target_layer_ids: list[int] | None = Field(
        None, description="DFlash ids (output of decoder layer L); null = paper default"
    )
    mask_token_id: int | None = Field(None, description="null = len(tokenizer)")
    attn_backend: Literal["auto", "sdpa", "flex"] = Field("auto", description="auto = flex on CUDA, sdpa on CPU")
    layer_types: list[str] | None = Field(
        None, description="per layer full_attention | sliding_attention; null = all full"
    )
    sliding_window: int | None = Field(None, ge=1, description="window of sliding_attention layers")
    draft_vocab_size: int = Field(32000, ge=1, description="EAGLE-3: draft vocabulary, the N most frequent "
                                  "supervised tokens (counted by tokenize, chosen by train)")
    ttt_steps: int = Field(7, ge=1, description="EAGLE-3: training-time-test unroll steps = drafts per round")
    ttt_decay: float = Field(0.8, gt=0.0, le=1.0, description="EAGLE-3: loss weight of unroll step i is decay^i")
    # The objective's options (`draftflow.drafters.objectives`); null = `train.recipe`'s choice.
    distill_top_k: int | None = Field(
        None, ge=0, description="labels: 0 = hard (the regenerated token; DFlash's paper recipe); k > 0 = soft, the "
        "target's top-k probabilities renormalised (DFlash: extract then also stores the target's final state); "
        "EAGLE-3's paper recipe scores the target's whole draft-vocabulary distribution (null under recipe paper)")
    acceptance_loss: bool | None = Field(
        None, description="add the gradient of each block's expected accepted length (LK-style, arXiv 2602.23881): "
        "a slot's loss -log(acceptance) is weighted by the accepted tokens that depend on it")


class TrainConfig(Section):
    epochs: int = Field(6, ge=1)
    max_steps: int | None = Field(None, ge=1, description="cap on optimizer steps")
    batch_size: int = Field(1, ge=1, description="sequences per optimizer step")
    lr: float = Field(6e-4, gt=0.0)
    warmup_ratio: float = Field(0.04, ge=0.0, lt=1.0)
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip: float = Field(1.0, gt=0.0)
    num_anchors: int = Field(512, ge=1)
    sampled_softmax: int | None = Field(
        None, ge=1, description="DFlash: score each block against the supervised tokens tokenize counted plus this "
        "many others drawn uniformly (log-Q corrected) instead of the whole vocabulary; null = the whole (the paper)")
    recipe: Literal["draftflow", "paper"] = Field(
        "draftflow", description="the defaults of the settings below left null: paper = the papers' recipe exactly "
        "(hard labels for DFlash, fixed steps, the last checkpoint); draftflow = layers from the target, held-out "
        "acceptance while training, the best checkpoint (docs/stages.md 'Recipes')")
    init_from_target: bool | None = Field(None, description="start the drafter's decoder layers from the target's "
                                          "last ones (tensors of matching name and shape); null = the recipe's")
    init_from: str | None = Field(
        None, description="warm start: every drafter weight from an export folder, a run root (its promoted "
        "drafter) or 'promoted' (this root's); same kind, shape, taps and vocabulary (draftflow.training.warm)")
    eval_every: int | Literal["auto", "off"] | None = Field(
        None, description="measure acceptance on held-out sequences every N steps (teacher-forced); auto = 20 times "
        "a run; off = never; null = the recipe's (paper: off, draftflow: auto)")
    heldout_fraction: float = Field(
        0.05, ge=0.0, lt=0.5, description="share of the training sequences held out (by id) for eval_every; at least "
        "one sequence, at most 512")
    keep: Literal["last", "best"] | None = Field(
        None, description="the exported drafter: the last step's, or the best held-out acceptance's (needs "
        "eval_every); null = the recipe's")
    patience: int | None = Field(None, ge=1, description="stop after this many held-out measurements without a "
                                 "better acceptance; null = train every step")
    gamma: float | None = Field(None, gt=0.0, description="null = 7/5/4 for B=16/10/8")
    checkpoint_every: int = Field(100, ge=1)
    device: Device = "auto"
    seed: int = 0
    length_buckets: bool = Field(True, description="batch_size > 1: group sequences of similar length")
    nproc_per_node: int = Field(1, ge=1, description="torchrun processes per node (one per GPU)")
    nnodes: int = Field(1, ge=1)
    rdzv_endpoint: str | None = Field(None, description="host:port of the rendezvous; null = local")
    launcher: Literal["auto", "inprocess", "torchrun"] = Field(
        "auto", description="auto = torchrun child processes when more than one process or on CUDA, else in-process")
    parallel: Literal["ddp", "fsdp"] = Field(
        "ddp", description="ddp: replicate the drafter, all-reduce gradients; fsdp: FSDP2-shard its trainable layers")
    bf16: bool = Field(True, description="bf16 autocast of the forward on CUDA (loss in fp32); ignored on CPU")
    timeout_s: float | None = Field(
        None, gt=0.0, description="torchrun launcher: kill the training processes after this many seconds")
    collective_timeout_s: float = Field(
        600.0, gt=0.0, description="several processes: a collective that waits longer for a peer (a node lost, a "
        "partitioned link) fails the run; longer than the slowest checkpoint write")


    @model_validator(mode="after")
    def _recipe(self) -> TrainConfig:
        """Fill the settings left null from `recipe`; `keep: best` needs held-out measurements."""
        paper = self.recipe == "paper"
        if self.init_from_target is None:
            self.init_from_target = not paper
        if self.eval_every is None:
            self.eval_every = "off" if paper else "auto"
        if self.keep is None:
            self.keep = "last" if paper or self.eval_every == "off" else "best"
        if self.eval_every == "off" and (self.keep == "best" or self.patience):
            raise ValueError("keep: best and patience need held-out measurements: set train.eval_every (or "
                             "leave it null under recipe draftflow)")
        if isinstance(self.eval_every, int) and self.eval_every < 1:
            raise ValueError("train.eval_every must be a step count >= 1, auto or off")
        return self


# The objective each recipe gives a drafter (docs/results.md "Recipes" has the ablation behind draftflow's): labels
# by kind (None: the kind's paper labels, hard for DFlash, the whole draft-vocabulary distribution for EAGLE-3).
RECIPE_OBJECTIVE: dict[str, dict[str, Any]] = {
    "paper": {"distill_top_k": {"dflash": 0}, "acceptance_loss": False},
    "draftflow": {"distill_top_k": {"dflash": 0}, "acceptance_loss": False},
}

