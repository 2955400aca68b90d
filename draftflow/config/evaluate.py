"""The `evaluate` config section (and its `gate`): what the evaluation package measures and decides.

Its own module because `draftflow.config` is at its size limit, and beside it rather than inside
`draftflow.evaluation`, whose modules import `draftflow.config`: a package on both sides of an import is
a two-way tie. `draftflow.config.RunConfig` holds it like every other section.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from draftflow.config.fields import Device, Section


class GateConfig(Section):
    """All unset (the default): no gate, nothing promoted or marked. Each set threshold is one check.

    The section is in no fingerprint (`config.NOT_FINGERPRINTED`): the gate is applied after the evaluate
    stage, also to a reused one, so changing a threshold never re-runs decoding. What the thresholds mean
    is `draftflow.evaluation.gate`.
    """

    min_tau: float | None = Field(None, ge=1.0, description="fail below this mean acceptance length")
    min_speedup: float | None = Field(
        None, gt=0.0,
        description="fail below the drafter's predicted speedup at its best setting (report.json speedup.predicted)",
    )
    max_regression: float | None = Field(
        None,
        ge=0.0,
        lt=1.0,
        description="fail when tau is more than this fraction below the best earlier "
        "evaluation of the same target and eval set in the run root (or below `baseline`); 0.05 = 5%",
    )
    max_category_regression: float | None = Field(
        None, ge=0.0, lt=1.0,
        description="fail when any category's tau is more than this fraction below the baseline's tau on that "
        "category (the baseline is max_regression's; needs max_regression): new data must not cost what was served",
    )
    baseline: str | None = Field(
        None,
        min_length=1,
        description="max_regression against this evaluation instead of the best earlier "
        "one: an evaluate fingerprint in the run root, an evaluate folder or its report.json",
    )

    @model_validator(mode="after")
    def _baseline_needs_regression(self) -> GateConfig:
        if self.max_category_regression is not None and self.max_regression is None:
            raise ValueError("evaluate.gate.max_category_regression compares with max_regression's baseline; set "
                             "evaluate.gate.max_regression too")
        if self.baseline is not None and self.max_regression is None:
            raise ValueError(
                "evaluate.gate.baseline is only used by max_regression; set evaluate.gate.max_regression "
                "too (0.05 = 5%)"
            )
        return self

    @property
    def active(self) -> bool:
        """Whether any threshold is set (else no gate is applied)."""
        return any(v is not None for v in (self.min_tau, self.min_speedup, self.max_regression))


class EvaluateConfig(Section):
    max_new_tokens: int = Field(128, ge=1)
    num_prompts: int | None = Field(None, ge=1, description="null = every eval prompt")
    device: Device = "auto"
    engine: Literal["hf", "vllm"] = Field(
        "hf", description="hf: draftflow's own speculative decoding; vllm: also serve both exports with vLLM's "
        "speculative decoding (settings from regenerate.vllm), check them lossless and compare vLLM's tau")
    vllm_tau_tolerance: float = Field(
        0.25, ge=0.0, description="engine=vllm: largest |tau(vLLM) - tau(draftflow)| before the stage fails")
    served_batches: list[Annotated[int, Field(ge=1)]] = Field(
        [1, 8], description="engine=vllm: batch sizes at which vLLM's tokens/s with and without each method is "
        "measured (the served speedup); [] = not measured")
    served_baselines: list[Literal["prompt_lookup"]] = Field(
        ["prompt_lookup"], description="engine=vllm: training-free methods also served and timed (vLLM's n-gram)")
    ddtree_budgets: list[Annotated[int, Field(ge=1)]] = [1, 4, 8, 16, 32]  # DFlash tree nodes b x (B-1); 1 = chain
    ddtree_prompts: int | None = Field(
        None, ge=1, description="DDTree on the first N evaluated prompts only (its loop re-reads the whole sequence "
        "every step, no KV cache: the slow part on a real target on CPU); null = all of them")
    categories: list[str] | None = Field(None, description="evaluate only these prompt categories; null = all")
    baselines: list[Literal["no_draft", "prompt_lookup"]] = ["no_draft", "prompt_lookup"]  # decoded on the same prompts
    kv_cache: bool = Field(True, description="KV-cached decoding (same tokens and tau); false = the uncached reference")
    compare_with: list[Annotated[str, Field(min_length=1)]] = Field(
        [], description="other trained drafters decoded on the same prompts: a train fingerprint of this root, a "
        "train stage folder or an export folder (draftflow.evaluation.compare_with); reported as drafter:<label>")
    alignment: bool = Field(True, description="DFlash: report the slot-label alignment check on the decoded outputs")
    gate: GateConfig = GateConfig()  # promotion thresholds, applied after the stage (in no fingerprint)
