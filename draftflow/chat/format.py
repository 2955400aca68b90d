"""`ChatFormat`: a tokenizer plus one chat template; serving prompt ids, completions, rows.

For assistant turn i of a conversation:

- the prompt p_i is what a serving engine (vLLM, SGLang) feeds the target for that history:
  `apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=True)`;
- the completion c_i is what the target emitted after p_i: the target's own ids when the
  regenerate stage kept them (`completions`), else derived from the template alone as
  render(messages[:i+1]) minus render(messages[:i], add_generation_prompt=True). The
  conversation is rendered *as it stood right after that turn was generated*, so a template
  that renders the last turn differently (gpt-oss: `<|return|>` for a final answer, `<|call|>`
  for a tool call, while later prompts show the same turn with `<|end|>`) gives the end marker
  the target really emitted. The end-of-turn marker is supervised (the drafter must learn to
  stop); whitespace the template adds after it is not, and neither is text a template appends
  only when a conversation is closed (Phi-3.5/Phi-4-mini append `eos_token`: found by comparing
  a user-only conversation rendered with and without the generation prompt).

What it deliberately does not know: model families. No registry of role markers or end tokens,
no reliance on `{% generation %}` (when a template has the tags, their mask is intersected with
the derived one and any difference is logged). Rows are assembled by `draftflow.chat.encode`.
The key trade-off: deriving c_i costs one extra render per turn, so prompts and completions of
many conversations are tokenized in one batched call (`encode_many`) to stay near raw speed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from draftflow.chat.encode import (
    DEFAULT_POLICY,
    EncodedRow,
    EncodeRequest,
    RowBuilder,
    assemble,
    check_policy,
    gc_paused,
)
from draftflow.chat.probe import prefix_stable
from draftflow.chat.render import GENERATION_TAG, Renderer, conversation_error, fixed_strftime_now
from draftflow.chat.tokens import tokenize_texts
from draftflow.chat.validate import supervised_turns, validate
from draftflow.compat import importing_transformers
from draftflow.errors import ConfigError, ConversationError

logger = logging.getLogger(__name__)

Message = Mapping[str, Any]
_Turn = tuple[int, str, str | None, list[int] | None]  # (index, prompt, completion text, ids)


def _key(kw: Mapping[str, Any]) -> str:
    return json.dumps(kw, sort_keys=True, default=repr)


class ChatFormat:
    """A tokenizer plus one chat template: prompt ids, completion ids and training rows.

    Args:
        tokenizer: a Hugging Face tokenizer (fast, for `generation_mask`).
        chat_template: Jinja template text; None uses the tokenizer's own template.
        template_kwargs: extra variables for every render (e.g. `{"enable_thinking": False}`);
            per-call keyword arguments override them.
        name: the model's name or path, for error messages.
        fast: faster render and tokenize calls, same output; False calls as transformers does.

    Raises:
        ConfigError: neither the tokenizer nor the caller provides a chat template, or the
            template is not valid Jinja.
    """

    def __init__(self, tokenizer: Any, chat_template: str | None = None,
                 template_kwargs: dict[str, Any] | None = None, name: str | None = None,
                 fast: bool = True) -> None:
        template = chat_template or getattr(tokenizer, "chat_template", None)
        if isinstance(template, Mapping):  # named templates: the default one serves chat
            template = template.get("default")
        if not isinstance(template, str) or not template.strip():
            raise ConfigError(
                f"the tokenizer of {name or 'the target'} has no chat template; pass "
                "chat_template=<Jinja text> (e.g. the target's chat_template.jinja) or use a "
                "model that ships one"
            )
        self.tokenizer = tokenizer
        self.chat_template: str = template
        self.template_kwargs: dict[str, Any] = dict(template_kwargs or {})
        self.fast = fast
        self.renderer = Renderer(template, tokenizer.special_tokens_map, fast)
        self._end_suffixes: dict[str, str] = {}
        self._stable: dict[str, bool] = {}

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs: Any) -> ChatFormat:
        """Load the tokenizer (and its template) from a local HF folder.

        Args:
            path: folder with tokenizer files.
            **kwargs: `chat_template` and `template_kwargs`, as for the constructor.

        Returns:
            A ChatFormat over that tokenizer.

        Raises:
            ConfigError: the folder cannot be loaded as a tokenizer, or it has no template (naming `path`).
        """
        with importing_transformers():
            from transformers import AutoTokenizer  # heavy import, only when loading

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"cannot load a tokenizer from {path}: {' '.join(str(exc).split())}; "
                "point target.path to a folder with tokenizer files"
            ) from exc
        return cls(tokenizer, name=str(path), **kwargs)

    @property
    def has_generation_tags(self) -> bool:
        """Whether the template marks assistant output with `{% generation %}`."""
        return bool(GENERATION_TAG.search(self.chat_template))

    # -- rendering and ids ---------------------------------------------------------------------

    def validate(self, messages: Sequence[Message]) -> None:
        """Check a conversation's shape (see `draftflow.chat.validate`).

        Raises:
            ConversationError: with a `reason` code.
        """
        validate(messages)

    def _kw(self, kw: Mapping[str, Any]) -> dict[str, Any]:
        return {**self.template_kwargs, **kw}

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False,
               **kw: Any) -> str:
        """Render a conversation to text, exactly as `apply_chat_template(tokenize=False)`.

        Args:
            messages: the conversation.
            add_generation_prompt: append the assistant header that starts a new turn.
            **kw: template variables (e.g. `enable_thinking`, `tools`).

        Returns:
            The rendered text.

        Raises:
            ConversationError: invalid conversation or a template error (`template_error`).
        """
        validate(messages)
        return self.renderer.render(messages, add_generation_prompt, self._kw(kw))

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, without added special tokens, in one batched call."""
        return tokenize_texts(self.tokenizer, texts, self.fast)

    def prompt_ids(self, messages: Sequence[Message], **kw: Any) -> list[int]:
        """The ids a serving engine computes for this history before generating.

        Args:
            messages: the history (must contain a user turn).
            **kw: template variables (e.g. `enable_thinking`, `tools`).

        Returns:
            `apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`.

        Raises:
            ConversationError: invalid conversation or a template error.
        """
        return self.tokenize([self.render(messages, add_generation_prompt=True, **kw)])[0]

    def completion_ids(self, history: Sequence[Message], message: Message, **kw: Any) -> list[int]:
        """The ids of one assistant message as the target emits them after `prompt_ids(history)`.

        Args:
            history: the messages before the assistant turn.
            message: the assistant message.
            **kw: template variables, as for `prompt_ids`.

        Returns:
            Token ids of the turn, ending with its end-of-turn marker (what follows it is dropped).

        Raises:
            ConversationError: `message` is not an assistant message, or `needs_completions`
                when the template's generation prompt is not a prefix of the rendered turn.
        """
        if not isinstance(message, Mapping) or message.get("role") != "assistant":
            raise conversation_error("bad_completions", "completion_ids needs an assistant message")
        kw = self._kw(kw)
        validate([*history, message])
        prompt = self.renderer.render(history, True, kw)
        return self.tokenize([self._completion_text(history, message, prompt, kw)])[0]

    def _completion_text(self, history: Sequence[Message], message: Message, prompt: str,
                         kw: Mapping[str, Any]) -> str:
        full = self.renderer.render([*history, message], False, kw)
        if not full.startswith(prompt):
            raise conversation_error(
                "needs_completions",
                f"the chat template's generation prompt is not a prefix of assistant turn "
                f"{len(history)} as rendered (it cannot be derived from the template); pass the "
                "target's generated ids as completions (run regenerate)",
            )
        text = full[len(prompt) :].rstrip()  # the stop token is learned, the template's "\n" not
        suffix = self._end_suffix(kw)
        if suffix and text.endswith(suffix):
            text = text[: -len(suffix)].rstrip()
        return text

    def _end_suffix(self, kw: Mapping[str, Any]) -> str:
        """Text the template appends only to a closed conversation (e.g. Phi's eos), or ''."""
        key = _key(kw)
        if key not in self._end_suffixes:
            self._end_suffixes[key] = self._probe_end_suffix(kw)
        return self._end_suffixes[key]

    def _probe_end_suffix(self, kw: Mapping[str, Any]) -> str:
        probe = [{"role": "user", "content": "Hi"}]
        try:
            closed = self.renderer.render(probe, False, kw)
            opened = self.renderer.render(probe, True, kw)
        except ConversationError:
            return ""
        if opened.startswith(closed):
            return ""
        a, b = self.tokenize([closed, opened])
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        suffix = self.tokenizer.decode(a[k:]).strip()
        found = bool(suffix) and closed.rstrip().endswith(suffix)
        logger.debug("closed-conversation suffix: %r", suffix if found else "")
        return suffix if found else ""

    # -- encoding ------------------------------------------------------------------------------

    def encode(self, messages: Sequence[Message], completions: Mapping[int, Sequence[int]] | None = None,
               max_length: int | None = None, policy: str = DEFAULT_POLICY, **kw: Any) -> list[EncodedRow]:
        """Encode one conversation into training rows with an assistant-only loss mask.

        Args:
            messages: the conversation.
            completions: the target's generated ids per assistant message index (including its
                end-of-turn token), supervised verbatim. Turns are supervised in order up to the
                first assistant turn without a (non-empty) entry. None derives every turn's ids
                from the template.
            max_length: truncate each row to this many tokens (rows left without a supervised
                token are dropped).
            policy: `auto` (default), `last_turn`, `per_turn` or `all_turns`; see
                `draftflow.chat.encode`.
            **kw: template variables, as for `prompt_ids`.

        Returns:
            The rows, in turn order (possibly empty after truncation).

        Raises:
            ConversationError: with a `reason` code (`draftflow.chat.REASONS`).
            ConfigError: unknown policy or max_length < 1.
        """
        (result,) = self.encode_many([EncodeRequest(messages, completions, kw)], max_length, policy)
        if isinstance(result, ConversationError):
            raise result
        return result

    def encode_many(self, requests: Sequence[EncodeRequest], max_length: int | None = None,
                    policy: str = DEFAULT_POLICY) -> list[list[EncodedRow] | ConversationError]:
        """Encode many conversations, tokenizing all their texts in one batched call.

        Args:
            requests: the conversations, each with its completions and template variables.
            max_length: as for `encode`.
            policy: as for `encode`.

        Returns:
            Per request, its rows or the ConversationError (with `reason`) that rejects it.

        Raises:
            ConfigError: unknown policy or max_length < 1.
        """
        check_policy(policy)
        if max_length is not None and max_length < 1:
            raise ConfigError(f"max_length must be a positive integer; got {max_length}")
        with gc_paused():
            return self._encode_batch(requests, max_length, policy)

    def _encode_batch(self, requests: Sequence[EncodeRequest], max_length: int | None,
                      policy: str) -> list[list[EncodedRow] | ConversationError]:
        plans: list[list[_Turn] | ConversationError] = []
        for request in requests:
            try:
                plans.append(self._plan(request, policy))
            except ConversationError as exc:
                plans.append(exc)
        texts = list(dict.fromkeys(
            t for p in plans if isinstance(p, list) for turn in p for t in turn[1:3] if t is not None
        ))
        ids = dict(zip(texts, self.tokenize(texts), strict=True))
        out: list[list[EncodedRow] | ConversationError] = []
        for request, plan in zip(requests, plans, strict=True):
            try:
                out.append(plan if isinstance(plan, ConversationError)
                           else self._rows(request, plan, ids, policy, max_length))
            except ConversationError as exc:
                out.append(exc)
        return out

    def _plan(self, request: EncodeRequest, policy: str) -> list[_Turn]:
        """Validate and render: (index, prompt text, completion text or None, given ids)."""
        messages, completions, kw = request.messages, request.completions, self._kw(request.template_kwargs)
        validate(messages)
        turns = supervised_turns(messages, completions)
        if policy == "last_turn":
            turns = turns[-1:]
        plan: list[_Turn] = []
        for i in turns:
            prompt = self.renderer.render(messages[:i], True, kw)
            if completions is not None:
                plan.append((i, prompt, None, list(completions[i])))
            else:
                plan.append((i, prompt, self._completion_text(messages[:i], messages[i], prompt, kw), None))
        return plan

    def _rows(self, request: EncodeRequest, plan: list[_Turn], ids: Mapping[str, list[int]],
              policy: str, max_length: int | None) -> list[EncodedRow]:
        triples = [(i, ids[p], given if given is not None else ids[c]) for i, p, c, given in plan]
        builders = assemble(triples, policy)
        if self.has_generation_tags and policy in ("auto", "all_turns"):
            for builder in builders:
                self._restrict_to_generation(builder, request)
        rows = [row for b in builders if (row := b.build(max_length)) is not None]
        logger.debug("encoded %d turns into %d rows (%s)", len(plan), len(rows), policy)
        return rows

    # -- {% generation %} and probes -------------------------------------------------------------

    def generation_mask(self, messages: Sequence[Message], **kw: Any) -> tuple[list[int], list[int]]:
        """transformers' own `{% generation %}` mask (for templates that have the tags).

        Args:
            messages: the conversation.
            **kw: template variables.

        Returns:
            (input_ids, assistant_mask) of the whole rendered conversation.

        Raises:
            ConfigError: the template has no `{% generation %}` tags (the mask would be all zero).
            ConversationError: invalid conversation or a template error.
        """
        if not self.has_generation_tags:
            raise ConfigError(
                "the chat template has no {% generation %} tags, so its assistant mask is all "
                "zero; use encode() instead"
            )
        validate(messages)
        self.renderer.render(messages, False, self._kw(kw))  # template errors -> template_error
        out = self.tokenizer.apply_chat_template(
            list(messages), chat_template=self.chat_template, tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True, **{"strftime_now": fixed_strftime_now, **self._kw(kw)},
        )
        return list(out["input_ids"]), list(out["assistant_masks"])

    def _restrict_to_generation(self, builder: RowBuilder, request: EncodeRequest) -> None:
        """Keep only supervised ids inside the template's generation blocks.

        The tags' mask also covers what is not generated after the serving prompt (SmolLM3's
        role header, the newline after the end marker): the intersection drops those. When the
        row is not the template's own tokenization (target ids given), the derived mask stays.
        """
        last = builder.spans[-1][0]
        ids, gen = self.generation_mask(request.messages[: last + 1], **request.template_kwargs)
        if ids[: len(builder.ids)] != builder.ids:
            return
        mask = [m & g for m, g in zip(builder.mask, gen, strict=False)]
        if mask != builder.mask:
            logger.warning(
                "{%% generation %%} leaves %d derived supervised tokens unmasked; using the tags",
                sum(builder.mask) - sum(mask),
            )
            builder.mask = mask

    def is_prefix_stable(self, **kw: Any) -> bool:
        """Whether `all_turns` is valid for this template: every later prompt extends the ids.

        Probes built-in multi-turn conversations (system prompt, reasoning as fields and inline;
        without the system prompt or with a probe tool when the template refuses them). Cached
        per template variables.

        Args:
            **kw: template variables (e.g. `enable_thinking`).

        Returns:
            False when some probe is not prefix-stable or none can be rendered.
        """
        key = _key(self._kw(kw))
        if key not in self._stable:
            self._stable[key] = prefix_stable(self, kw)
        return self._stable[key]
