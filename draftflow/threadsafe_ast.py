"""`ast.parse` made safe to call from several threads at once, on the Pythons that need it.

Why: before CPython 3.13 the counter that guards the depth of the Python objects `ast.parse` builds lives in
the interpreter's shared AST state, not in each call (python/cpython gh-106905, fixed by gh-113035 for 3.13;
which 3.11 and 3.12 point releases carry the backport is not something to rely on). A call can let another
thread run mid-way (the garbage collector runs finalizers, which are Python code), and when that thread parses
too, one of the two fails with `SystemError: AST constructor recursion depth mismatch (before=57, after=76)`.
In a stage's flow process that happens without any parse of ours: a shard task's thread imports transformers,
and torch._dynamo's import calls `inspect.signature` on builtins (which parses their text signatures) while
Prefect's event-loop threads do the same through pydantic, and the code hash parses the library's imports.
CI failed on it once (the GPU-limit deployments test, a regenerate flow run Failed with that message).

What it does: `install()` (run by `draftflow/__init__.py`, so every process that imports the library, a
worker's spawned children included, has it before its task threads start) replaces `ast.parse` with a wrapper
that holds one process-wide re-entrant lock while the original runs. `inspect`, torch and pydantic look
`ast.parse` up on the module at each call, so theirs go through it too; a direct
`compile(..., ast.PyCF_ONLY_AST)` does not (none of the libraries a stage runs does this in a thread).

Key trade-off: patching the standard library for every user of the process, against a failure that is rare,
silent until it strikes and not ours to fix. A parse takes milliseconds; parses are already serial under the
GIL, so the lock costs nothing measurable. On 3.13 and later `install()` changes nothing.
"""

from __future__ import annotations

import ast
import functools
import sys
import threading
from typing import Any

FIXED_IN = (3, 13)
_LOCK = threading.RLock()  # re-entrant: a finalizer that runs mid-parse may parse in the same thread


def install() -> bool:
    """Serialize `ast.parse` in this process where the interpreter needs it; True if it is (now or before)."""
    if sys.version_info >= FIXED_IN:
        return False
    if getattr(ast.parse, "serialized_by_draftflow", False):
        return True
    unsafe = ast.parse

    @functools.wraps(unsafe)
    def parse(*args: Any, **kwargs: Any) -> Any:
        with _LOCK:
            return unsafe(*args, **kwargs)

    parse.serialized_by_draftflow = True  # type: ignore[attr-defined]
    ast.parse = parse
    return True
