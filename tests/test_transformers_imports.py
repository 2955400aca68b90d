"""Every import from transformers in the library holds `compat.importing_transformers()`.

transformers' lazy top-level module is not thread-safe on first use: shard tasks (threads) that first import
`AutoTokenizer` at once failed with "cannot import name 'AutoTokenizer' from 'transformers'" (docs/measurements.md,
nineteenth entry). A source scan checks each import sits in the lock's block; fresh interpreters whose threads import
at once through it get no error.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Copied into DFlash's vLLM exports, which load it without draftflow: it imports transformers at its top level, when
# the drafter registry loads the kind (one thread).
STANDALONE = {"draftflow/drafters/dflash/modeling_dflash.py"}


def _unlocked_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    locked: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.With) and any(
                isinstance(i.context_expr, ast.Call) and getattr(i.context_expr.func, "id", "") ==
                "importing_transformers" for i in node.items):
            locked.update(id(s) for s in node.body)
    out = []
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        if any(n == "transformers" or n.startswith("transformers.") for n in names) and id(node) not in locked:
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return out


def test_every_library_import_from_transformers_holds_the_lock():
    files = [p for p in sorted((ROOT / "draftflow").rglob("*.py")) if str(p.relative_to(ROOT)) not in STANDALONE]
    unlocked = [hit for p in files for hit in _unlocked_imports(p)]
    assert unlocked == [], f"wrap these in `with importing_transformers():` (draftflow/compat.py): {unlocked}"
    assert len([p for p in files if "importing_transformers()" in p.read_text()]) >= 10  # the scan sees them


RACE = """
import threading
from draftflow.compat import importing_transformers
errors, start = [], threading.Barrier(6)
def first_use():
    start.wait()
    try:
        with importing_transformers():
            from transformers import AutoTokenizer, AutoConfig  # noqa: F401
    except Exception as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=first_use) for _ in range(6)]
[t.start() for t in threads]
[t.join() for t in threads]
print(len(errors), errors[:1])
"""


def test_threads_that_first_import_transformers_at_once_all_get_it():
    """A fresh interpreter (only the first use races); without the lock this failed in 1 of 3 here (4 threads)."""
    done = subprocess.run([sys.executable, "-c", RACE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("0 "), done.stdout + done.stderr[-2000:]
