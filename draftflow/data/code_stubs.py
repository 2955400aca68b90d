"""Code-stub prompts: "complete this function" asks built from Python source that is already installed.

HumanEval-style prompts (a signature and its docstring, asked as in `sources.HUMANEVAL_ASK`) teach a
drafter what code answers do most: repeat the prompt's names, signature and docstring. No dataset ships
them here, but every machine has thousands in the Python standard library (and in any installed
package): each public top-level function with a docstring becomes one prompt, cut after its docstring
(the target writes the body). A drafter trained only on chat prompts never sees that copying; on
SmolLM2 it lost HumanEval to prompt lookup, whose best case it is (docs/measurements.md, 2026-12-03).

The chosen stubs (ordered by sha256(seed, stub), the first `count`) are written as a prompt-format
JSONL file (`{"prompt": ...}` per line) in the cache, named by the sha256 of its content, which is
curate's key for the source: it changes exactly when the prompts do (another Python version or build,
another package version), not when the cache is wiped or the run moves to another machine. The files
are parsed again at each `plan`, `status` and `run` (~2.5 s for the standard library).
Eval prompts such as HumanEval's stay out of training through curate's decontamination, like any
source's. This module knows nothing of curate nor of Prefect.
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import os
import sysconfig
import tokenize
import warnings
from collections.abc import Iterator
from pathlib import Path

from draftflow.config.curate import CodeStubsConfig
from draftflow.data.readers import import_folder
from draftflow.data.sources import HUMANEVAL_ASK
from draftflow.errors import ConfigError
from draftflow.kept import default_cache_dir
from draftflow.store import write_local_atomic

log = logging.getLogger(__name__)
STDLIB = "stdlib"
# Folders whose code is tests, demos or vendored copies, not the API a user asks about (private ones such as
# _vendor and __pycache__ are left out by `_public`).
SKIP_DIRS = frozenset({"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "dist-packages",
                       "ensurepip", "vendor"})


def package_root(name: str, source: str) -> Path:
    """The folder of the standard library (`stdlib`) or of an installed package (import name).

    Raises:
        ConfigError: the package is not installed or is a single module without a folder.
    """
    if name == STDLIB:
        return Path(sysconfig.get_paths()["stdlib"])
    folder = import_folder(name)
    if folder is None:
        raise ConfigError(f"source '{source}': code_stubs.packages names {name}, which is not an installed package "
                          f"with a folder (a single module has none): install it, or name another")
    return Path(folder)


def _public(name: str) -> bool:
    return not name.startswith(("_", ".")) or name == "__init__.py"


def python_files(root: Path) -> list[Path]:
    """The public .py files under `root`, sorted: no SKIP_DIRS, no private (`_x`) or hidden folders or modules."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and _public(d))
        found += [Path(folder) / f for f in files if f.endswith(".py") and _public(f)]
    return sorted(found)


def _parse(source: str) -> ast.Module | None:
    with warnings.catch_warnings():  # invalid escapes in other people's code are not our warnings
        warnings.simplefilter("ignore")
        try:
            return ast.parse(source)
        except (SyntaxError, ValueError, RecursionError, MemoryError):  # Python 2 leftovers, null bytes, depth
            return None


def stubs_in(source: str, cfg: CodeStubsConfig) -> Iterator[str]:
    """Each public top-level function of a module's source, as its `def` line(s) through its docstring.

    A function qualifies when its name has no leading underscore, its docstring (the first statement, on a
    line of its own) has at least `min_doc_chars` characters and holds no code fence; a stub longer than
    `max_chars` is skipped, not cut (a cut docstring would teach a broken prompt). Decorators are left out.
    Unparsable source yields nothing.
    """
    tree = _parse(source)
    if tree is None:
        return
    lines = source.split("\n")  # ast counts lines at "\n" only (str.splitlines also splits at \x0c, \x85, ...)
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc, first = ast.get_docstring(node), node.body[0]
        if doc is None or len(doc) < cfg.min_doc_chars or "```" in doc or first.lineno == node.lineno:
            continue  # a one-line def (`def f(): """doc"""; return 1`) has no body left to write
        if len(node.body) > 1 and node.body[1].lineno == first.end_lineno:
            continue  # `"""doc"""; return 1`: the body shares the docstring's line
        stub = "\n".join(lines[node.lineno - 1:first.end_lineno]).rstrip() + "\n"
        if len(stub) <= cfg.max_chars and stub.startswith(("def ", "async def ")):
            yield stub


def read_source(path: Path) -> str | None:
    """A module's text as Python reads it (its coding line or BOM honoured, newlines as "\n"); None if unreadable."""
    try:
        with tokenize.open(path) as f:
            return f.read()
    except (SyntaxError, UnicodeDecodeError, OSError):  # an unknown coding line, bad bytes, a broken link
        return None


def collect(cfg: CodeStubsConfig, source: str = "code_stubs") -> list[str]:
    """Every distinct stub of the configured packages, in file order (`source` names the source in errors)."""
    seen: dict[str, None] = {}
    for name in cfg.packages:
        for path in python_files(package_root(name, source)):
            if (text := read_source(path)) is not None:
                seen.update(dict.fromkeys(stubs_in(text, cfg)))
    return list(seen)


def choose(stubs: list[str], count: int, seed: int) -> list[str]:
    """The first `count` stubs ordered by sha256(seed, stub): stable under files being added or removed."""
    def key(stub: str) -> bytes:
        return hashlib.sha256(f"{seed}\0{stub}".encode()).digest()

    return sorted(stubs, key=key)[:count]


def prompts_file(cfg: CodeStubsConfig, source: str = "code_stubs", cache_dir: Path | None = None) -> str:
    """The local path of the prompts file for this config, written unless the cache holds its content.

    Args:
        source: the source's name, for errors.

    Raises:
        ConfigError: a package is not installed, or the packages hold no qualifying function.
    """
    stubs = choose(collect(cfg, source), cfg.count, cfg.seed)
    if not stubs:
        raise ConfigError(f"source '{source}': no public function with a docstring of {cfg.min_doc_chars}+ "
                          f"characters in {', '.join(cfg.packages)}; lower code_stubs.min_doc_chars or name "
                          "other packages")
    if len(stubs) < cfg.count:
        log.warning("%s: %d of %d code stubs (the packages hold no more)", source, len(stubs), cfg.count)
    body = "".join(json.dumps({"prompt": HUMANEVAL_ASK.format(code=s)}, ensure_ascii=False) + "\n" for s in stubs)
    name = hashlib.sha256(body.encode()).hexdigest()[:32]
    path = Path(cache_dir or default_cache_dir()) / "code_stubs" / f"{name}.jsonl"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_local_atomic(path, lambda tmp: Path(tmp).write_text(body, encoding="utf-8"))
        log.info("%s: %d code stubs from %s in %s", source, len(stubs), ", ".join(cfg.packages), path)
    return str(path)
