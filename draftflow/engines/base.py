"""The engine interface: conversations in, completions (ids and/or text) out.

Every request carries both forms of its prompt: the messages with their
template variables (what an OpenAI-compatible chat endpoint takes; the server
applies the same chat template) and the serving prompt ids (what offline
engines take, rendered by `ChatFormat.prompt_ids`). An engine that returns
token ids lets the tokenize stage supervise exactly what the target produced;
a text-only engine (HTTP chat) leaves `ids=None` and tokenize derives them
from the template.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class GenRequest:
    messages: list[dict[str, Any]]
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. enable_thinking, tools
    prompt_ids: list[int] = field(default_factory=list)
    # This request's sampling seed (None: the params' seed). vLLM seeds each request, so identical prompts
    # need their own seeds to differ; the hf engine seeds once per batch (rows differ) and ignores it.
    seed: int | None = None


@dataclass
class Completion:
    ids: list[int] | None  # generated ids incl. the end-of-turn token when produced; None if text-only
    text: str  # the completion's text without the end-of-turn token
    finish_reason: str  # "stop" (end of turn) or "length" (max_new_tokens reached)
    prompt_tokens: int
    completion_tokens: int = 0
    reasoning: str | None = None  # set when the engine (or a server-side parser) separated it


class Engine(Protocol):
    name: str
    model_id: str

    def generate(self, requests: list[GenRequest], params: SamplingParams) -> list[Completion]:
        """One completion per request, in order."""
        ...

    def close(self) -> None:
        """Release connections / GPU memory."""
        ...
