"""The `refresh` section: where a scheduled refresh reads new traffic and how it judges the candidate
(`draftflow refresh`, `flows/refresh.py`). In no stage's fingerprint: a refresh turns its traffic into curate
sources, and those are what the stages hash.
"""

from __future__ import annotations

from pydantic import Field

from draftflow.config.fields import Section


class RefreshConfig(Section):
    """New traffic in, a warm-started candidate out, promoted only when it beats the live drafter."""

    traffic: str | None = Field(None, min_length=1, description="folder or s3:// prefix of request logs "
                                "(JSONL of OpenAI chat-completions requests); `draftflow refresh --traffic` sets it")
    holdout: float = Field(0.1, ge=0.0, lt=1.0, description="share of each new batch kept out of training as the "
                           "'recent' eval category")
    category: str = Field("recent", min_length=1, description="the eval category of each batch's held-out slice")
    max_regression: float = Field(0.0, ge=0.0, lt=1.0, description="the candidate may fall at most this share "
                                  "below the live drafter's tau on the same prompts and still be promoted")
    max_category_regression: float | None = Field(0.05, ge=0.0, lt=1.0, description="nor may any eval category "
                                                  "fall more than this share below the live drafter's tau on it "
                                                  "(new traffic must not cost what is already served); null: off")
    warm_steps: float | None = Field(0.3, gt=0.0, le=1.0, description="a warm-started refresh trains this share "
                                     "of train.max_steps (null: all of them)")
    warm_lr: float | None = Field(0.3, gt=0.0, le=1.0, description="a warm-started refresh trains at this share of "
                                  "train.lr (null: all of it): a fresh optimizer at full rate jolts a trained drafter")
    min_rows: int = Field(1, ge=1, description="fewer new conversations than this: the refresh does nothing")
