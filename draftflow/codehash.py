"""Which library source a stage's results depend on, as one hash per stage.

A stage fingerprint includes the code that computes the stage (contract 1). Hashing the
whole library made every edit, even to the trainer, recompute curation, regeneration and
terabytes of features. Here a stage's code is `draftflow/stages/<stage>.py` plus every
library module it imports, directly or transitively, found by reading the import
statements of each file (module-level and inside functions, absolute and relative), plus
the package `__init__` files on the way and the bundled assets. The versions of the third-party
libraries that shape a stage's bytes (`StageSpec.libraries`: transformers renders chat templates and
runs the target, tokenizers tokenizes, torch computes) are another of its fingerprint inputs
(`stages.registry.stage_inputs`, shown in its manifest's `inputs.libraries`).

What it cannot read: modules reached by a computed name (importlib with a string). The drafter
registries load each kind's modules by the kind's name, and the config loads each kind's own settings
(`drafters/<kind>/settings.py`, so an edit there re-runs every stage: the config is in every stage's
code), so `COMPUTED` names the files such a module may load, and they count as imported;
`tests/test_codehash.py` fails on any other computed import (the stage registry's own does not reach any
stage's code, see there).

Key trade-off: static imports over-approximate (a module imported for one helper counts
whole), which errs towards recomputing; never towards a stale result.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from collections.abc import Iterator
from pathlib import Path

from draftflow.kept import kept_answer

PACKAGE = "draftflow"
ROOT = Path(__file__).parent
# Modules that import others by a computed name -> the files they may import: patterns in which {kind} is
# each drafter kind, as `draftflow/drafters/taps.py` lists them (`KINDS`, read from the source, not imported).
COMPUTED = {
    f"{PACKAGE}.drafters.taps": ("drafters/{kind}/taps.py",),
    f"{PACKAGE}.drafters.registry": ("drafters/{kind}/*.py",),
    f"{PACKAGE}.config.train": ("drafters/{kind}/settings.py",),  # a kind's own settings (`kind_settings`)
}
KINDS_FILE = "drafters/taps.py"


def module_file(root: Path, module: str) -> Path | None:
    """The source file of a dotted module name under the package at `root` (None: not ours)."""
    parts = module.split(".")
    if parts[0] != root.name:
        return None
    base = root.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = [root.name, *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(root: Path, path: Path) -> frozenset[str]:
    """Dotted names of every library module `path` imports, anywhere in the file."""
    st = path.stat()
    return _imported_version(root, path, st.st_mtime_ns, st.st_size)


@functools.cache  # stages share most of their modules: each version of a file is read once per process
def _imported_version(root: Path, path: Path, mtime_ns: int, size: int) -> frozenset[str]:
    """Parsing is most of a closure's cost (~1 s of a process's ~1.4 s for the six stages and preflight): the answer
    is kept on disk under the file's place in the package (its module and package, which relative imports resolve
    against) and its bytes' sha256 (`kept.kept_answer`), so a machine parses each version of a file once. The bytes,
    not the mtime, are the key: a stale answer cannot outlive an edit."""
    source = path.read_bytes()
    this = _module_name(root, path)
    key = f"imports-v1 {root.name}/{path.relative_to(root)} {hashlib.sha256(source).hexdigest()}"
    kept = kept_answer("code-imports", key, lambda: "\n".join(sorted(_parsed_imports(this, path, source))))
    return frozenset(kept.split("\n")) - {""}


def _parsed_imports(this: str, path: Path, source: bytes) -> set[str]:
    """Dotted names of every module of the package (`this`'s first part) that `source` imports, anywhere in it."""
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    names: set[str] = set()
    for node in _statements(ast.parse(source, filename=str(path)).body):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import submodule`
    return {n for n in names if n.split(".")[0] == this.split(".")[0]}


def _statements(nodes: list[ast.AST]) -> Iterator[ast.AST]:
    """Every statement in `nodes` and the blocks nested in them (an import is always a statement;
    skipping expressions makes this several times faster than `ast.walk`)."""
    for node in nodes:
        yield node
        for block in ("body", "orelse", "finalbody", "handlers", "cases"):
            yield from _statements(getattr(node, block, None) or [])


def closure(root: Path, module: str) -> list[Path]:
    """Source files of `module` and everything it imports from the package, with parent `__init__`s."""
    seen: set[Path] = set()
    todo, named, found = [module], set(), {}
    while todo:
        name = todo.pop()
        if name in named:  # most names are imported by many files: each is looked up once
            continue
        named.add(name)
        parts = name.split(".")
        # Importing a.b.c runs a/__init__ and a/b/__init__ first.
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix not in found:  # looked up once a closure (a file's presence can change between closures)
                found[prefix] = module_file(root, prefix)
            f = found[prefix]
            if f is not None and f not in seen:
                seen.add(f)
                todo.extend(_imported(root, f))
                todo.extend(_computed(root, prefix))
    return sorted(seen)


def _kinds(root: Path) -> tuple[str, ...]:
    """`KINDS` as `KINDS_FILE` assigns it (a literal tuple of folder names)."""
    for node in ast.parse((root / KINDS_FILE).read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "KINDS" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise ValueError(f"{root / KINDS_FILE} assigns no KINDS tuple")


def _computed(root: Path, module: str) -> list[str]:
    """The modules `module` imports by a computed name (`COMPUTED`), as dotted names: only listed kinds' files, so
    a kind folder that is not in `KINDS` (work in progress) changes no fingerprint."""
    patterns = COMPUTED.get(module, ())
    kinds = _kinds(root) if patterns else ()
    return [_module_name(root, p) for g in patterns for k in kinds for p in sorted(root.glob(g.format(kind=k)))]


def source_hash(root: Path, files: list[Path], extra_dirs: tuple[str, ...] = ("assets",)) -> str:
    """sha256 over the files' relative paths and bytes, plus every file under `extra_dirs`."""
    h = hashlib.sha256()
    data = [f for d in extra_dirs for f in sorted((root / d).rglob("*")) if f.is_file()]
    for f in [*files, *data]:
        h.update(str(f.relative_to(root)).encode() + b"\0")
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def library_versions(names: tuple[str, ...]) -> str:
    """Installed versions of the named packages as `name=version;...`, without local build tags
    (2.13.0+cpu -> 2.13.0), so a CPU worker and a GPU worker with the same release agree."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in names:
        try:
            out.append(f"{name}={version(name).split('+')[0]}")
        except PackageNotFoundError:
            out.append(f"{name}=absent")
    return ";".join(out)


@functools.cache
def stage_code_hash(stage: str) -> str:
    """Hash of the draftflow code that computes `stage` (see the module docstring)."""
    return source_hash(ROOT, closure(ROOT, f"{PACKAGE}.stages.{stage}"))


@functools.lru_cache(maxsize=1)
def library_hash() -> str:
    """Hash of every library source file (what a run records as its code version)."""
    return source_hash(ROOT, sorted(ROOT.rglob("*.py")))
