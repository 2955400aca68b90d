"""The engine interface: token ids in, completions (ids + finish reason) out.

Engines take prompts as token ids (rendered by `ChatFormat.prompt_ids`, the
same ids a server computes) and return the generated ids, so the tokenize
stage can supervise exactly the tokens the target produced.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Completion:
    ids: list[int]  # generated ids, including the end-of-turn token when it was produced
    finish_reason: str  # "stop" (end-of-turn produced) or "length" (max_new_tokens reached)
    prompt_tokens: int


class Engine(Protocol):
    name: str
    model_id: str

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """One completion per prompt, in order."""
        ...
