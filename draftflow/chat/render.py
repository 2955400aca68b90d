"""Render a chat template directly through its compiled Jinja template.

`apply_chat_template` re-reads the tokenizer's special-token map, converts tools and walks a
generic code path on every call; the tokenize stage renders each conversation several times, so
`Renderer` compiles the template once, in the same sandboxed environment transformers uses
(trim_blocks, lstrip_blocks, loopcontrols, `tojson` without HTML escaping, `raise_exception`,
a `{% generation %}` tag that renders its body), and renders with the same variables
(`messages`, `tools`, `documents`, `add_generation_prompt`, the special tokens, then the caller's
keyword arguments). Tests check that the text equals `apply_chat_template`'s on every template.

What it deliberately does not know: anything about model families. The key trade-off: a private
copy of transformers' environment is fast but could drift from it; the golden tests catch that.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from inspect import isfunction
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from draftflow.compat import importing_transformers
from draftflow.errors import ConfigError, ConversationError

logger = logging.getLogger(__name__)

# Templates that call strftime_now (gpt-oss, SmolLM3, ...) render this date, so renders are
# reproducible; it equals the Llama-3.1 template's own default "26 Jul 2024".
FIXED_DATE = datetime(2024, 7, 26)
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# What a template can raise while rendering a conversation it does not support.
TEMPLATE_ERRORS = (jinja2.TemplateError, TypeError, KeyError, IndexError, ValueError, AttributeError)


def one_line(text: object) -> str:
    """Collapse whitespace so an error message stays on one line."""
    return " ".join(str(text).split())


def conversation_error(reason: str, message: str) -> ConversationError:
    """A ConversationError with a short machine-readable `reason` code (see `REASONS`)."""
    exc = ConversationError(one_line(message))
    exc.reason = reason  # type: ignore[attr-defined]
    return exc


def fixed_strftime_now(fmt: str) -> str:
    """`strftime_now` for templates, pinned to FIXED_DATE."""
    return FIXED_DATE.strftime(fmt)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _Generation(Extension):
    """`{% generation %}…{% endgeneration %}` renders its body (masks come from transformers)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


_DICT_ATTRIBUTES = frozenset(dir(dict))
# str methods the sandbox always allows (not private; format/format_map it wraps, so they go through it)
_SAFE_STR_METHODS = frozenset(n for n in dir(str) if not n.startswith("_") and n not in ("format", "format_map"))
# `ns.x` and `loop.index0`: Jinja's own objects, neither mutable containers nor internal types
_JINJA_STATE = (Namespace, LoopContext)
_MISSING = object()


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with the attribute look-ups templates make most answered directly.

    `message.role` on a dict and `content.strip` on a str cost the sandbox a failed getattr, an
    exception and four safety checks each; rendering is dominated by them. For a plain `dict` and
    an attribute name no dict has, the parent always ends at `obj[attribute]` (or undefined); for a
    plain `str` and a public method other than format/format_map, its safety checks always pass.
    A public non-callable attribute of Jinja's `namespace()` and `loop` objects always passes them
    too. Those cases are answered here with the parent's own result; every other look-up
    (subclasses, dict methods, private names, methods of other objects) goes through the parent.
    """

    def getattr(self, obj: Any, attribute: str) -> Any:
        kind = type(obj)
        if kind is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except LookupError:
                return self.undefined(obj=obj, name=attribute)
        if kind is str and attribute in _SAFE_STR_METHODS:
            return getattr(obj, attribute)
        if kind in _JINJA_STATE and not attribute.startswith("_"):
            value = getattr(obj, attribute, _MISSING)
            if value is not _MISSING and not callable(value):
                return value
        return super().getattr(obj, attribute)


def compile_template(text: str, fast: bool = True) -> jinja2.Template:
    """Compile template text in transformers' chat-template environment.

    Args:
        text: the template.
        fast: answer common attribute look-ups directly (`_ChatSandbox`); False uses Jinja's
            `ImmutableSandboxedEnvironment` as transformers does (the reference the tests compare with).

    Raises:
        ConfigError: the text is not valid Jinja.
    """
    env = (_ChatSandbox if fast else ImmutableSandboxedEnvironment)(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = fixed_strftime_now
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(
            f"the chat template is not valid Jinja (line {exc.lineno}: {one_line(exc.message)}); "
            "fix chat_template"
        ) from exc


def _tool_schemas(tools: Any) -> Any:
    """Functions become JSON schemas, as in apply_chat_template; dicts pass through."""
    if tools is None or not any(isfunction(t) for t in tools):
        return tools
    with importing_transformers():
        from transformers.utils import get_json_schema

    return [get_json_schema(t) if isfunction(t) else t for t in tools]


class Renderer:
    """One compiled template plus the variables every render gets.

    Args:
        chat_template: Jinja text.
        special_tokens: the tokenizer's `special_tokens_map` (bos_token, eos_token, ...).
        fast: as for `compile_template`.
    """

    def __init__(self, chat_template: str, special_tokens: Mapping[str, Any], fast: bool = True) -> None:
        self.template = compile_template(chat_template, fast)
        self.special_tokens = dict(special_tokens)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
               kw: Mapping[str, Any]) -> str:
        """Render like `apply_chat_template(messages, tokenize=False, **kw)`.

        Raises:
            ConversationError: reason `template_error`, with the template's own message.
        """
        variables = {"strftime_now": fixed_strftime_now, **self.special_tokens, **kw}
        variables["tools"] = _tool_schemas(variables.get("tools"))
        variables.setdefault("documents", None)
        try:
            return self.template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **variables
            )
        except TEMPLATE_ERRORS as exc:
            kind = "" if isinstance(exc, jinja2.TemplateError) else f"{type(exc).__name__}: "
            raise conversation_error(
                "template_error",
                f"the chat template cannot render this conversation ({kind}{exc}); "
                "fix the conversation or its template_kwargs",
            ) from exc
