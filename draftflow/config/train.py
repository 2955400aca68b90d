"""The `drafter` and `train` config sections, and the recipes that fill what they leave unset.

A recipe (`train.recipe`) names a set of defaults, not a code path: `paper` is the papers' recipe exactly
(DFlash arXiv 2602.06036, EAGLE-3 arXiv 2503.01840: hard labels for DFlash, fixed steps, the last checkpoint),
`draftflow` adds the target's layers as the start, held-out acceptance while training and the best checkpoint,
and the objective options the ablation chose (`RECIPE_OBJECTIVE`). Any setting written out wins over its
recipe. Kept apart from `draftflow.config`, which re-exports both sections, to keep each module readable.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import pkgutil
from typing import Any, Literal, TypeVar

from pydantic import ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from draftflow.config.fields import Device, Section

S = TypeVar("S", bound=Section)


class DrafterConfig(Section):
    """The drafter's kind and the fields every kind reads; each kind's own fields (DFlash's block and taps,
    EAGLE-3's unroll and draft vocabulary) are written in the same section and belong to the kind: its
    `draftflow/drafters/<kind>/settings.py` declares and validates them (`kind_settings`), so a field another
    kind owns, or a misspelt one, is a one-line error naming the key. The depth (`num_layers`) is the kind's too:
    DFlash's default is 5, EAGLE-3's is the paper's one."""

    # Assignments are checked by `__setattr__` (the whole section, the kind's rules included), not field by field.
    model_config = ConfigDict(extra="allow", validate_assignment=False)

    kind: str = Field("dflash", description="drafter algorithm: a kind of the drafter registry "
                      "(`draftflow.drafters`: dflash, eagle3), checked at preflight")
    target_layer_ids: list[int] | None = Field(
        None, description="taps, draftflow ids (output of decoder layer L); null = the kind's default"
    )
    attn_backend: Literal["auto", "sdpa", "flex"] = Field("auto", description="auto = flex on CUDA, sdpa on CPU")
    # The objective's options (`draftflow.drafters.objectives`); null = `train.recipe`'s choice.
    distill_top_k: int | None = Field(
        None, ge=0, description="labels: 0 = hard (the regenerated token; DFlash's paper recipe); k > 0 = soft, the "
        "target's top-k probabilities renormalised (DFlash: extract then also stores the target's final state); "
        "EAGLE-3's paper recipe scores the target's whole draft-vocabulary distribution (null under recipe paper)")
    acceptance_loss: bool | None = Field(
        None, description="add the gradient of each block's expected accepted length (LK-style, arXiv 2602.23881): "
        "a slot's loss -log(acceptance) is weighted by the accepted tokens that depend on it")

    @model_validator(mode="after")
    def _kind_settings(self) -> DrafterConfig:
        """The fields beyond the shared ones, validated by the kind's settings and filled with its defaults (so a
        default written out fingerprints as one left out)."""
        owned = kind_settings(self.kind)
        if owned is None:  # not a kind's folder: preflight names the known kinds
            return self
        extra = self.__pydantic_extra__ or {}
        unknown = sorted(set(extra) - set(owned.model_fields))
        if unknown:
            raise PydanticCustomError(
                "kind_setting", "unknown config key '{key}' for drafter.kind {kind} (its own settings: {own})",
                {"key": f"drafter.{unknown[0]}", "kind": self.kind, "own": ", ".join(owned.model_fields) or "none"})
        try:
            values = owned.model_validate(extra)
        except ValidationError as err:
            first = err.errors()[0]
            key = "drafter." + ".".join(str(p) for p in first["loc"])
            raise PydanticCustomError("kind_setting", "invalid value of '{key}': {msg}",
                                      {"key": key, "msg": first["msg"]}) from None
        self.__pydantic_extra__ = values.model_dump()
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        """Assign after the whole section with the new value validates (a field another kind owns, a bad value, a
        `kind` whose settings the other fields do not fit): a refused assignment leaves the section as it was."""
        if name.startswith("_"):
            return super().__setattr__(name, value)
        checked = type(self).model_validate({**self.model_dump(), name: value})
        object.__setattr__(self, "__dict__", checked.__dict__)
        object.__setattr__(self, "__pydantic_extra__", checked.__pydantic_extra__)
        object.__setattr__(self, "__pydantic_fields_set__", self.__pydantic_fields_set__ | {name})

    def own(self, settings: type[S]) -> S:
        """This section's kind-owned fields as the kind's settings model (typed access for its parts)."""
        return settings.model_validate(self.__pydantic_extra__ or {})


def kind_settings(kind: str) -> type[Section] | None:
    """`draftflow/drafters/<kind>/settings.py`'s `SETTINGS`, the fields that kind owns; a kind folder without one
    owns none (`Section`); None: no folder of that name. Imported by the kind's name, as the drafter registry
    imports a kind's spec (`draftflow.codehash.COMPUTED` counts the file in every stage's code hash): the config is
    below the drafters' layer and must not import a kind by a written import."""
    found = importlib.util.find_spec(f"draftflow.drafters.{kind}") if kind.isidentifier() else None
    if found is None or found.submodule_search_locations is None:  # a kind is a folder (registry.py is none)
        return None
    try:
        module = importlib.import_module(f"draftflow.drafters.{kind}.settings")
    except ModuleNotFoundError as exc:
        if exc.name != f"draftflow.drafters.{kind}.settings":
            raise
        return Section
    return module.SETTINGS


@functools.cache
def kinds_own_fields() -> frozenset[str]:
    """Every field some kind folder's settings declare (a stage fingerprints `drafter.num_taps`, which EAGLE-3 has
    not: absent there, never misspelt)."""
    folder = importlib.util.find_spec("draftflow.drafters").submodule_search_locations  # by name, as kind_settings
    return frozenset(f for m in pkgutil.iter_modules(folder) if m.ispkg
                     for f in (kind_settings(m.name) or Section).model_fields)


def kept_for_kind(section: dict[str, Any], kind: Any) -> dict[str, Any]:
    """A config file's `drafter` section for `--set drafter.kind=K` over a file written for another kind: the
    file's kind's own fields are left out unless K varies that kind (one's settings extend the other's) and has
    them: DFlash's depth, block and taps carry over to `flat`, none of them to EAGLE-3. Every other key stays, so
    a misspelt one is still an error. The fields left out are logged (a file naming another kind replaces the
    section)."""
    owned = kind_settings(kind) if isinstance(kind, str) else None
    before = section.get("kind", DrafterConfig.model_fields["kind"].default)
    theirs = kind_settings(before) if isinstance(before, str) else None
    if owned is None or theirs is None:
        return section
    related = issubclass(owned, theirs) or issubclass(theirs, owned)
    keep = set(DrafterConfig.model_fields) | (set(owned.model_fields) if related else set())
    dropped = sorted(k for k in section if k not in keep and k in theirs.model_fields)
    if dropped:
        logging.getLogger(__name__).info("drafter.kind=%s: the config file's %s left out (not settings of %s)", kind,
                                         ", ".join(f"drafter.{k}" for k in dropped), kind)
    return {k: v for k, v in section.items() if k not in dropped}


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
        None, ge=1, description="score each block (DFlash) or unroll step (EAGLE-3: of its draft vocabulary) against "
        "the supervised tokens tokenize counted plus this many others drawn uniformly (log-Q corrected) instead of "
        "the whole vocabulary; null = the whole (the paper)")
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
    gamma: float | Literal["measured"] | None = Field(
        None, description="DFlash: slot k's loss weight is exp(-(k-1)/gamma); measured (DFlash and EAGLE-3): the "
        "probability that decoding reaches slot (unroll step) k, from each held-out measurement (the paper's decay "
        "before the first; needs eval_every), EAGLE-3 unrolling only the steps reached 1% of the time or more; "
        "null = the recipe's: measured under draftflow with held-out measurements, else the paper's 7/5/4 for "
        "B=16/10/8")
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
        if self.gamma is None and not paper and self.eval_every != "off":
            self.gamma = "measured"  # slot weights follow what decoding reaches (docs/results.md "Recipes")
        if self.eval_every == "off" and (self.keep == "best" or self.patience):
            raise ValueError("keep: best and patience need held-out measurements: set train.eval_every (or "
                             "leave it null under recipe draftflow)")
        if isinstance(self.gamma, float) and self.gamma <= 0:
            raise ValueError("train.gamma must be > 0, measured or null")
        if isinstance(self.eval_every, int) and self.eval_every < 1:
            raise ValueError("train.eval_every must be a step count >= 1, auto or off")
        return self


# The objective each recipe gives a drafter (docs/results.md "Recipes" has the ablation behind draftflow's): labels
# by kind (None: the kind's paper labels, hard for DFlash, the whole draft-vocabulary distribution for EAGLE-3), and
# EAGLE-3's scored positions (its own `drafter.draftable`); `RunConfig._objective_recipe` fills each left null.
RECIPE_OBJECTIVE: dict[str, dict[str, Any]] = {
    "paper": {"distill_top_k": {"dflash": 0}, "acceptance_loss": False, "draftable": {"eagle3": "target"}},
    "draftflow": {"distill_top_k": {"dflash": 0}, "acceptance_loss": False, "draftable": {"eagle3": "tokens"}},
}

