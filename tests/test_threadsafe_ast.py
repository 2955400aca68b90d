"""`draftflow.threadsafe_ast`: threads that parse at once, with garbage whose finalizers run mid-parse, fail on
CPython < 3.13 without it (CI's failure: a regenerate flow run Failed with the SystemError) and never with it."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

import draftflow  # noqa: F401  (installs the guard)
from draftflow import threadsafe_ast

# Three threads parse the same source while cycles of objects with finalizers are freed: the collector runs a
# finalizer mid-parse, the finalizer lets another thread run, and that thread's parse resets the shared counter.
WORKLOAD = """
import sys, threading, time
if sys.argv[1] == "guarded":
    import draftflow  # noqa: F401
import ast

SOURCE = "\\n".join(f"def f{i}(a, b=1, *c, **d):\\n    return [x for x in (a, b, c, d) if x]\\n" for i in range(300))


class Finalized:
    def __del__(self):
        time.sleep(0)


errors = []


def work():
    for _ in range(10):
        junk = [Finalized() for _ in range(50)]
        for j in junk:
            j.me = j
        del junk
        try:
            ast.parse(SOURCE)
        except SystemError as e:
            errors.append(str(e))
            return


sys.setswitchinterval(1e-6)
threads = [threading.Thread(target=work) for _ in range(3)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(len(errors), errors[:1])
"""


def _errors(tmp_path, mode: str) -> str:
    script = tmp_path / "workload.py"
    script.write_text(WORKLOAD)
    proc = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


def test_importing_the_library_serializes_ast_parse_where_the_interpreter_needs_it():
    assert threadsafe_ast.install() is (sys.version_info < threadsafe_ast.FIXED_IN)
    if sys.version_info < threadsafe_ast.FIXED_IN:
        assert getattr(ast.parse, "serialized_by_draftflow", False)
        assert threadsafe_ast.install()
        assert not getattr(ast.parse.__wrapped__, "serialized_by_draftflow", False)  # installed once, not nested
        assert isinstance(ast.parse("x = 1"), ast.Module)


def test_threads_parsing_at_once_never_fail_once_the_library_is_imported(tmp_path):
    unguarded = _errors(tmp_path, "raw")
    if unguarded.startswith("0 "):
        pytest.skip(f"this interpreter ({sys.version.split()[0]}) does not fail the workload unguarded")
    assert "AST constructor recursion depth mismatch" in unguarded  # the interpreter's bug, reproduced
    assert _errors(tmp_path, "guarded") == "0 []"
