"""Constrained value types of the run config (a torch device, a regex, a thinking fraction) and the
base of its sections.

Checked when the config loads, so a typo stops a run before any work, in one line that names the
field (pydantic puts the field's dotted path in front of these messages). The config sections in
`draftflow.config` use them; this module knows nothing of sections or stages.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


def _regex(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as exc:  # not a ValueError: pydantic would let it escape as a traceback
        raise ValueError(f"{pattern!r} is not a regex: {exc}") from None
    return pattern


def _fraction(value: bool | float) -> bool | float:
    if not isinstance(value, bool) and not 0.0 <= value <= 1.0:
        raise ValueError(f"must be true, false or a fraction in 0..1, got {value}")
    return value


Device = Annotated[str, Field(pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$", description="auto | cpu | mps | cuda | cuda:N")]
Regex = Annotated[str, AfterValidator(_regex)]
# true / false, or the share of conversations (0..1) that get it on.
BoolOrFraction = Annotated[bool | float, AfterValidator(_fraction)]


class Section(BaseModel):
    """Base for every config section: unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
