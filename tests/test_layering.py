"""Conventions enforced by tests: the library never imports Prefect; imports point down."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imports(folder: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in (ROOT / folder).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
    return found


def test_library_source_never_imports_prefect_or_upper_layers():
    for path, names in _imports("draftflow").items():
        assert not names & {"prefect", "flows", "tasks"}, f"{path} imports {names & {'prefect', 'flows', 'tasks'}}"


def test_tasks_do_not_import_flows():
    for path, names in _imports("tasks").items():
        assert "flows" not in names, path


def test_importing_every_library_module_leaves_prefect_unloaded():
    code = (
        "import importlib, pkgutil, sys, draftflow\n"
        "for m in pkgutil.walk_packages(draftflow.__path__, 'draftflow.'):\n"
        "    importlib.import_module(m.name)\n"
        "bad = sorted(k for k in sys.modules if k == 'prefect' or k.startswith('prefect.'))\n"
        "print(len(bad)); sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_vllm_is_never_imported_at_module_level():
    for path, names in _imports("draftflow").items():
        assert "vllm" not in names or "engines/vllm" in path, path
