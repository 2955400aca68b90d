"""The `evaluate.gate` config section: thresholds that decide whether a trained drafter is promoted.

Its own module because `draftflow.config` is at its size limit. The section is in no fingerprint
(`config.NOT_FINGERPRINTED`): the gate is applied after the evaluate stage, also to a reused one,
so changing a threshold never re-runs decoding. What the thresholds mean is `draftflow.evaluation.gate`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class GateConfig(BaseModel):
    """All unset (the default): no gate, nothing promoted or marked. Each set threshold is one check."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)  # as config.Section

    min_tau: float | None = Field(None, ge=1.0, description="fail below this mean acceptance length")
    min_speedup: float | None = Field(
        None, gt=0.0, description="fail below this projected speedup (report.json speedup.projected)"
    )
    max_regression: float | None = Field(
        None,
        ge=0.0,
        lt=1.0,
        description="fail when tau is more than this fraction below the best earlier "
        "evaluation of the same target and eval set in the run root (or below `baseline`); 0.05 = 5%",
    )
    baseline: str | None = Field(
        None,
        min_length=1,
        description="max_regression against this evaluation instead of the best earlier "
        "one: an evaluate fingerprint in the run root, an evaluate folder or its report.json",
    )

    @model_validator(mode="after")
    def _baseline_needs_regression(self) -> GateConfig:
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
