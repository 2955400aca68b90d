"""Imports form no circles and point down: the import graph of draftflow, flows and tasks is acyclic,
and no module imports from a layer above its own (`LAYERS`, the one place the order is written).

Every `import` and `from ... import` statement counts, at module level or inside a function
(a function-level import only hides a circle until that function runs). A name is resolved
to the project module that defines it: `from a.b import c` is an edge to `a.b.c` when that is
a module, else to `a.b`. Importing `a.b` also runs `a/__init__`, but that implicit edge is
left out: a package `__init__` that gathers its submodules' names (`draftflow.chat`) would
otherwise count as a circle with each of them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("draftflow", "flows", "tasks")


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """{module: the project modules it imports}, for every module of `packages` under `root`."""
    files = {_module_name(root, p): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: anchor at this package, one level up per extra dot
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in files else base)
        graph[name] = {_owner(t, files) for t in targets if _owner(t, files)} - {None}
    return graph


def _owner(target: str, files: dict) -> str | None:
    """The longest project module that `target` names (`a.b.C` -> `a.b`), or None."""
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in files:
            return ".".join(parts[:i])
    return None


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    """Modules reachable from `start` by one or more edges (`start` itself only through a cycle)."""
    seen: set[str] = set()
    todo = list(graph.get(start, ()))
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo.extend(graph.get(v, ()))
    return seen


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a -> ... -> a) per strongly connected component that has one.

    Quadratic (a reachability set per module), which is nothing for ~100 modules and easy to check.
    """
    reach = {v: _reach(graph, v) for v in graph}
    done: set[str] = set()
    found = []
    for v in sorted(graph):
        if v in done or v not in reach[v]:
            continue
        component = {w for w in reach[v] if v in reach[w]}  # holds v: v reaches itself
        done |= component
        found.append(_cycle_in(graph, component))
    return found


def _cycle_in(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest cycle through the component's first module, staying inside the component."""
    start = min(comp)
    paths = {start: [start]}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v] & comp):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                todo.append(w)
    raise AssertionError(f"no cycle in component {comp}")


def test_the_import_graph_has_no_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in found)


def test_the_cycle_finder_finds_function_level_and_relative_cycles(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from pkg import b\n",
        "b.py": "def f():\n    from .sub.c import g\n",  # function-level, relative
        "sub/__init__.py": "",
        "sub/c.py": "import pkg.a\n",
        "d.py": "from pkg.a import x\n",  # into the cycle, not part of it
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.b"] == {"pkg.sub.c"} and graph["pkg.d"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]
    (pkg / "sub/c.py").write_text("import os\nimport pkg\n")  # the package itself, no module of the cycle
    assert cycles(import_graph(tmp_path, ("pkg",))) == []


# The layers, lowest first: a module imports from its own layer and those below, never from one above.
# Each subpackage of draftflow is a layer (`LAYERS` names packages only); every top-level module of draftflow
# (errors, store, contracts, ...) and the config package are the base layer below them all, so a new one
# starts there. Adding a drafter kind adds to `drafters`; a stage, to `stages`.
LAYERS = (
    ("chat", ("draftflow.chat",)),
    ("engines", ("draftflow.engines",)),
    ("data", ("draftflow.data",)),
    ("models", ("draftflow.models",)),
    ("drafters", ("draftflow.drafters",)),
    ("training", ("draftflow.training",)),
    ("evaluation", ("draftflow.evaluation",)),
    ("stages", ("draftflow.stages",)),
    ("runs", ("draftflow.runs",)),  # what a run's results say, and the plan before it: read by the CLI
    ("refresh", ("draftflow.refresh",)),  # traffic batches and the refresh history, read by the refresh flow
    ("tasks", ("tasks",)),
    ("flows", ("flows",)),
)


def layer_of(module: str) -> int:
    """`module`'s index in `LAYERS` plus one (0: draftflow's base layer)."""
    for i, (_, prefixes) in enumerate(LAYERS, start=1):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return 0


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    names = ["base", *(name for name, _ in LAYERS)]
    return [f"{a} ({names[layer_of(a)]}) imports {b} ({names[layer_of(b)]})"
            for a in sorted(graph) for b in sorted(graph[a]) if layer_of(b) > layer_of(a)]


def test_imports_point_down_the_layers():
    found = upward_imports(import_graph())
    assert not found, "imports from a higher layer:\n" + "\n".join("  " + f for f in found)


def test_the_layer_check_catches_an_upward_import():
    graph = import_graph()
    assert upward_imports(graph) == [] and "draftflow.drafters.eagle3.model" in graph
    graph = {**graph, "draftflow.models.blocks": graph["draftflow.models.blocks"] | {"draftflow.drafters.spec"}}
    assert upward_imports(graph) == ["draftflow.models.blocks (models) imports draftflow.drafters.spec (drafters)"]
    assert layer_of("draftflow.errors") == 0 < layer_of("draftflow.chat.render") < layer_of("flows.cli")


def test_no_module_is_over_400_lines():
    """CONVENTIONS: files under ~400 lines; a file that grows past it is split by responsibility."""
    root = Path(__file__).resolve().parent.parent
    long = {str(p.relative_to(root)): n for pkg in ("draftflow", "flows", "tasks") for p in (root / pkg).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


def test_evaluation_asks_a_kinds_spec_and_imports_no_kind():
    """DDTree and the alignment check ask the spec (`block_logits`, `slot_drafts`) whether a kind proposes trees or
    has slots: a new kind with those parts gets both without an edit here."""
    kinds = ("draftflow.drafters.dflash", "draftflow.drafters.eagle3")
    found = [f"{a} imports {b}" for a, deps in import_graph().items() if a.startswith("draftflow.evaluation")
             for b in sorted(deps) if b.startswith(kinds)]
    assert found == []


def test_the_library_keeps_its_modules_in_packages():
    """At most 20 modules at the top of draftflow/: the rest live in the package of their layer."""
    top = sorted(p.name for p in (ROOT / "draftflow").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 20, top


def _closure(graph: dict[str, set[str]], module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += graph.get(m, ())
    return seen


def test_the_gate_is_handed_its_evaluation_and_never_reloads_a_config():
    """The evaluate flow's gate judges the result it is handed (`evalruns.of_result`): of the run-results modules its
    imports reach only evalruns, no status reader or plan (`compare` resolves a config to its evaluation, not the
    gate, which never loads a config: `load_config` is not called on its path)."""
    reached = _closure(import_graph(), "draftflow.runs.gating")
    runs = {m for m in reached if m.startswith("draftflow.runs.")}
    assert runs == {"draftflow.runs.gating", "draftflow.runs.evalruns"}, sorted(runs)  # was 4: + runinfo, runstate


def test_a_runs_start_imports_neither_transformers_nor_torchs_distributed_checkpoint():
    """`draftflow run` imports the pipeline's flows; what a run whose stages are all reused never uses is imported
    when first used (transformers ~1.5 s, torch.distributed.checkpoint ~1.7 s of a start on 2 cores)."""
    lazy = ("transformers", "torch.distributed.checkpoint.state_dict")
    probe = f"import sys, flows.pipeline; print([m for m in {lazy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
