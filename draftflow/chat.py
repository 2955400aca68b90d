"""Render conversations with the target's chat template; token ids and assistant loss masks.

`ChatFormat` wraps a Hugging Face tokenizer and one chat template. It computes:

- `prompt_ids(history)`: exactly the ids a serving engine (vLLM, SGLang) feeds the target for
  this history: `apply_chat_template(history, add_generation_prompt=True, tokenize=True)`.
- `completion_ids(history, message)`: the ids of one assistant turn as the target emits them after
  that prompt, derived from the template alone: render(history + [message]) minus
  render(history, add_generation_prompt=True), with the template's whitespace after the
  end-of-turn marker dropped (generation stops at the marker, so the marker is supervised and
  the newline after it is not).
- `encode(messages)`: training rows of (input_ids, loss_mask) where every supervised span is
  preceded by exactly the prompt ids serving computes for its history.

What it deliberately does not know: model families. There is no per-template registry of role
markers or end tokens and no reliance on `{% generation %}` tags (nearly every shipped template
lacks them, and `return_assistant_tokens_mask` then returns an all-zero mask silently).
Everything is derived by rendering and diffing; golden tests on real templates prove it.

The key trade-off: templates that rewrite history (Qwen3 drops earlier reasoning, adds an empty
think block only to the last turn) make a later prompt differ from the tokens the model generated
earlier. `encode` then starts a new row (one row per such turn, re-encoding the shared history)
instead of training a turn on a context that serving never produces. Prefix-stable templates
still get one row per conversation, so the extra compute is paid only where correctness needs it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2

from draftflow.errors import ConversationError, DraftflowError

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
# Templates that call strftime_now (gpt-oss, SmolLM3, ...) render this date, so renders are
# reproducible; it equals the Llama-3.1 template's own default "26 Jul 2024".
FIXED_DATE = datetime(2024, 7, 26)
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

Message = Mapping[str, Any]


@dataclass
class EncodedRow:
    """One training row.

    Attributes:
        input_ids: token ids of the row.
        loss_mask: 1 where the token is a supervised target-generated token, else 0.
        turns: indices (into the conversation) of the assistant messages supervised in this row.
    """

    input_ids: list[int]
    loss_mask: list[int]
    turns: list[int]


@dataclass
class _RowBuilder:
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    spans: list[tuple[int, int, int]] = field(default_factory=list)  # (turn, start, end)

    def add(self, turn: int, prompt: list[int], completion: list[int]) -> None:
        """Append the unseen tail of `prompt` unsupervised, then `completion` supervised."""
        tail = prompt[len(self.ids) :]
        self.ids += tail + completion
        self.mask += [0] * len(tail) + [1] * len(completion)
        self.spans.append((turn, len(self.ids) - len(completion), len(self.ids)))

    def build(self, max_length: int | None) -> EncodedRow | None:
        """Truncate to `max_length`; None when no supervised token survives."""
        end = len(self.ids) if max_length is None else min(max_length, len(self.ids))
        turns = [turn for turn, start, _ in self.spans if start < end]
        if not turns:
            return None
        return EncodedRow(list(self.ids[:end]), list(self.mask[:end]), turns)


def _fixed_strftime_now(fmt: str) -> str:
    return FIXED_DATE.strftime(fmt)


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


class ChatFormat:
    """A tokenizer plus one chat template: prompt ids, completion ids and loss masks.

    Args:
        tokenizer: a Hugging Face tokenizer (fast, for `generation_mask`).
        chat_template: Jinja template text; None uses the tokenizer's own template.
        template_kwargs: extra variables for every render (e.g. `{"enable_thinking": False}`);
            per-call keyword arguments override them.

    Raises:
        DraftflowError: neither the tokenizer nor the caller provides a chat template.
    """

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        template = chat_template or getattr(tokenizer, "chat_template", None)
        if not isinstance(template, str) or not template.strip():
            raise DraftflowError(
                "the tokenizer has no chat template; pass chat_template=<Jinja text> "
                "(e.g. the target's chat_template.jinja)"
            )
        self.tokenizer = tokenizer
        self.chat_template: str = template
        self.template_kwargs: dict[str, Any] = dict(template_kwargs or {})

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs: Any) -> ChatFormat:
        """Load the tokenizer (and its template) from a local HF folder.

        Args:
            path: folder with tokenizer files (tokenizer.json or vocab.json + merges.txt,
                tokenizer_config.json).
            **kwargs: `chat_template` and `template_kwargs`, as for the constructor.

        Returns:
            A ChatFormat over that tokenizer.

        Raises:
            DraftflowError: the folder cannot be loaded as a tokenizer, or it has no template.
        """
        from transformers import AutoTokenizer  # heavy import, only when loading

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as exc:
            raise DraftflowError(
                f"cannot load a tokenizer from {path}: {_one_line(exc)}; "
                "point to a folder with tokenizer files"
            ) from exc
        return cls(tokenizer, **kwargs)

    @property
    def has_generation_tags(self) -> bool:
        """Whether the template marks assistant output with `{% generation %}`."""
        return bool(_GENERATION_TAG.search(self.chat_template))

    # -- validation and rendering -------------------------------------------------------------

    def validate(self, messages: Sequence[Message]) -> None:
        """Check a conversation before it reaches the template.

        Args:
            messages: list of `{"role", "content", "reasoning_content"?}` dicts.

        Raises:
            ConversationError: empty conversation, a non-dict message, unknown role,
                non-string content or reasoning_content, or no user turn.
        """
        if not messages:
            raise ConversationError("conversation is empty; drop it before tokenizing")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise ConversationError(
                    f"message {i} is not a dict; each message needs role and content"
                )
            role = message.get("role")
            if role not in ROLES:
                raise ConversationError(
                    f"message {i} has unknown role {role!r}; use one of {', '.join(ROLES)}"
                )
            if not isinstance(message.get("content"), str):
                kind = type(message.get("content")).__name__
                raise ConversationError(
                    f"message {i} ({role}) has {kind} content; "
                    "content must be a string (use '' for none)"
                )
            reasoning = message.get("reasoning_content")
            if reasoning is not None and not isinstance(reasoning, str):
                raise ConversationError(
                    f"message {i} ({role}) has non-string reasoning_content; use a string or None"
                )
        if not any(m["role"] == "user" for m in messages):
            raise ConversationError(
                "conversation has no user turn; add one or drop the conversation at curation"
            )

    def _kwargs(self, kw: Mapping[str, Any]) -> dict[str, Any]:
        return {"strftime_now": _fixed_strftime_now, **self.template_kwargs, **kw}

    def _apply(self, messages: Sequence[Message], **kwargs: Any) -> Any:
        """Validate, then call `apply_chat_template`; template errors become one-line errors."""
        self.validate(messages)
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), chat_template=self.chat_template, **kwargs
            )
        except (jinja2.TemplateError, TypeError, KeyError, IndexError) as exc:
            raise ConversationError(
                f"the chat template cannot render this conversation ({type(exc).__name__}: "
                f"{_one_line(exc)}); fix the conversation or its template_kwargs"
            ) from exc

    def render(
        self, messages: Sequence[Message], add_generation_prompt: bool = False, **kw: Any
    ) -> str:
        """Render a conversation to text with the template.

        Args:
            messages: the conversation.
            add_generation_prompt: append the assistant header that starts a new turn.
            **kw: template variables (e.g. `enable_thinking`, `tools`).

        Returns:
            The rendered text.

        Raises:
            ConversationError: invalid conversation or a template error.
        """
        return self._apply(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self._kwargs(kw),
        )

    # -- ids ----------------------------------------------------------------------------------

    def prompt_ids(self, messages: Sequence[Message], **kw: Any) -> list[int]:
        """The ids a serving engine computes for this history before generating.

        Args:
            messages: the history (must contain a user turn).
            **kw: template variables (e.g. `enable_thinking`, `tools`).

        Returns:
            `apply_chat_template(messages, add_generation_prompt=True, tokenize=True)` as a list.

        Raises:
            ConversationError: invalid conversation or a template error.
        """
        out = self._apply(messages, tokenize=True, add_generation_prompt=True, **self._kwargs(kw))
        if isinstance(out, Mapping):  # transformers 5 returns a BatchEncoding
            out = out["input_ids"]
        return list(out)

    def completion_ids(self, history: Sequence[Message], message: Message, **kw: Any) -> list[int]:
        """The ids of one assistant message as the target emits them after `prompt_ids(history)`.

        Args:
            history: the messages before the assistant turn.
            message: the assistant message.
            **kw: template variables, as for `prompt_ids`.

        Returns:
            Token ids of the turn, ending with the end-of-turn marker (trailing whitespace dropped).

        Raises:
            ConversationError: `message` is not an assistant message, or the template does not
                render the generation prompt as a prefix of the rendered turn.
        """
        if not isinstance(message, Mapping) or message.get("role") != "assistant":
            raise ConversationError("completion_ids needs an assistant message; got another role")
        prompt = self.render(history, add_generation_prompt=True, **kw)
        full = self.render([*history, message], add_generation_prompt=False, **kw)
        if not full.startswith(prompt):
            raise ConversationError(
                f"chat template is not prefix-stable for assistant turn {len(history)} (the "
                "generation prompt is not a prefix of the rendered turn); "
                "pass the target's generated ids as completions"
            )
        text = full[len(prompt) :].rstrip()  # the stop token is learned, the template's "\n" is not
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode(
        self,
        messages: Sequence[Message],
        completions: Mapping[int, Sequence[int]] | None = None,
        max_length: int | None = None,
        **kw: Any,
    ) -> list[EncodedRow]:
        """Encode a conversation into training rows with an assistant-only loss mask.

        For each assistant turn i (in order): p = prompt_ids(messages[:i]) and c = the turn's ids.
        The turn joins the current row when p starts with the row's ids (p's tail is appended
        unsupervised, c supervised); otherwise it starts a new row p + c. Every supervised span is
        thus preceded by exactly the ids serving computes for its history.

        Args:
            messages: the conversation.
            completions: the target's generated ids per assistant message index (including its
                end-of-turn token). When given, turns are supervised in order up to the first
                assistant turn without a (non-empty) entry; later turns are not encoded, since
                their history would hold an answer the target did not generate. When None,
                every assistant turn is supervised with `completion_ids`.
            max_length: truncate each row to this many tokens (rows left without a supervised
                token are dropped).
            **kw: template variables, as for `prompt_ids`.

        Returns:
            The rows, in turn order (possibly empty after truncation).

        Raises:
            ConversationError: invalid conversation, no assistant turn, bad completions keys,
                or a template that is not prefix-stable when completions are derived.
        """
        self.validate(messages)
        turns = self._supervised_turns(messages, completions)
        if max_length is not None and max_length < 1:
            raise ConversationError(f"max_length must be a positive integer; got {max_length}")
        builders: list[_RowBuilder] = []
        for i in turns:
            p = self.prompt_ids(messages[:i], **kw)
            if completions is not None:
                c = list(completions[i])
            else:
                c = self.completion_ids(messages[:i], messages[i], **kw)
            if not c:
                logger.debug("assistant turn %d has no tokens; not supervised", i)
                continue
            if not builders or p[: len(builders[-1].ids)] != builders[-1].ids:
                builders.append(_RowBuilder())  # the template rewrote history: a new row
            builders[-1].add(i, p, c)
        rows = [row for b in builders if (row := b.build(max_length)) is not None]
        logger.debug("encoded %d turns into %d rows", len(turns), len(rows))
        return rows

    def _supervised_turns(
        self, messages: Sequence[Message], completions: Mapping[int, Sequence[int]] | None
    ) -> list[int]:
        """Assistant indices to supervise, in order.

        Turns before the first user turn are part of the prompt, not answers. With completions,
        supervision stops at the first assistant turn without a generated answer: every later
        row would contain that turn in its history.
        """
        first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
        assistant = [
            i for i, m in enumerate(messages) if m["role"] == "assistant" and i > first_user
        ]
        if not assistant:
            raise ConversationError(
                "conversation has no assistant turn after a user turn; regenerate it or drop it"
            )
        if completions is None:
            return assistant
        stray = sorted(set(completions) - set(assistant))
        if stray:
            raise ConversationError(
                f"completions given for messages {stray} that are not assistant turns after a user "
                "turn; key completions by the assistant message index"
            )
        kept: list[int] = []
        for i in assistant:
            if not completions.get(i):
                logger.debug(
                    "assistant turn %d has no generated answer; later turns not encoded", i
                )
                break
            kept.append(i)
        return kept

    def generation_mask(
        self, messages: Sequence[Message], **kw: Any
    ) -> tuple[list[int], list[int]]:
        """The template's own `{% generation %}` mask (for templates that have the tags).

        Args:
            messages: the conversation.
            **kw: template variables.

        Returns:
            (input_ids, assistant_mask) of the whole rendered conversation.

        Raises:
            DraftflowError: the template has no `{% generation %}` tags (the mask would be
                all zero).
            ConversationError: invalid conversation or a template error.
        """
        if not self.has_generation_tags:
            raise DraftflowError(
                "the chat template has no {% generation %} tags, so its assistant mask is "
                "all zero; use encode() instead"
            )
        out = self._apply(
            messages,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            **self._kwargs(kw),
        )
        return list(out["input_ids"]), list(out["assistant_masks"])
