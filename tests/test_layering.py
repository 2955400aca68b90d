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


# Calls that open a stage's folder in the store: their first argument is the stage.
FOLDER_CALLS = {"stage_path", "read_manifest", "write_manifest", "verify_sha", "open_features", "path"}


def stage_folders_named(root: Path = ROOT / "draftflow") -> list[str]:
    """Calls in the library that open a stage's folder by a literal stage name (or a module constant holding one),
    other than the stage's own module naming its own folder and the registry."""
    from draftflow.stages.registry import stage_names

    names, found = set(stage_names()), []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        if rel == "draftflow/stages/registry.py":
            continue
        tree = ast.parse(path.read_text())
        consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign) and
                  isinstance(n.value, ast.Constant) for t in n.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute | ast.Name)):
                continue
            func = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            first = node.args[0]
            value = first.value if isinstance(first, ast.Constant) else consts.get(getattr(first, "id", None))
            if func in FOLDER_CALLS and value in names and rel != f"draftflow/stages/{value}.py":
                found.append(f"{rel}:{node.lineno} {func}({value!r}, ...)")
    return found


def test_no_library_code_opens_another_stages_folder_by_its_name():
    """A stage is handed its inputs (their stage and fingerprint travel with them), and code outside the stages
    finds a folder by what it holds (`registry.maker`): a stage put in between, or renamed, breaks nothing."""
    assert stage_folders_named() == []


def test_the_stage_folder_check_sees_a_literal_and_a_constant(tmp_path):
    pkg = tmp_path / "draftflow"
    pkg.mkdir()
    (pkg / "m.py").write_text('S = "tokenize"\n\ndef f(store):\n    store.read_manifest("train", "fp")\n'
                              '    return store.stage_path(S, "fp"), store.path("logs")\n')
    assert stage_folders_named(pkg) == ["draftflow/m.py:4 read_manifest('train', ...)",
                                        "draftflow/m.py:5 stage_path('tokenize', ...)"]
