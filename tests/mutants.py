"""Put a known bug back into a library function, for tests that prove a guard can fail.

A guard test is only as good as the bug it catches. Rather than rebuild the buggy
behaviour in the test (which shows only that the test's own copy differs), `mutant`
edits the *library's* source of one function (one exact text replacement, so the
mutant follows the code as it changes) and compiles it in the function's own module
namespace. `put_back` installs it where callers look it up, until the test ends.

When a refactor removes the text a mutant replaces, `mutant` fails with a message
that names the function and the text: update the mutant rather than drop the guard.
"""

from __future__ import annotations
import __future__

import inspect
import textwrap
from collections.abc import Callable
from typing import Any


def mutant(func: Callable[..., Any], old: str, new: str) -> Callable[..., Any]:
    """`func` with the one occurrence of `old` in its source replaced by `new`.

    Args:
        func: a module-level library function (not a method or closure).
        old: text that occurs exactly once in `func`'s source.
        new: its replacement (the bug).

    Returns:
        A new function object with `func`'s name, globals and defaults.

    Raises:
        AssertionError: `old` does not occur exactly once (the code moved on: update the mutant).
    """
    src = textwrap.dedent(inspect.getsource(func))
    count = src.count(old)
    assert count == 1, f"{func.__module__}.{func.__qualname__}: {old!r} occurs {count} times; update the mutant"
    namespace: dict[str, Any] = {}  # the def lands here; the module's globals stay untouched but live
    code = compile(
        src.replace(old, new),
        f"<mutant of {func.__module__}.{func.__qualname__}>",
        "exec",
        flags=__future__.annotations.compiler_flag,
        dont_inherit=True,
    )
    exec(code, func.__globals__, namespace)  # noqa: S102 - the library's own source, edited
    fn = namespace[func.__name__]
    fn.__defaults__, fn.__kwdefaults__ = func.__defaults__, func.__kwdefaults__
    return fn


def put_back(monkeypatch, module, name: str, old: str, new: str) -> Callable[..., Any]:
    """Replace `module.name` by its mutant until the test ends (callers in `module` see it); return it."""
    fn = mutant(getattr(module, name), old, new)
    monkeypatch.setattr(module, name, fn)
    return fn
