"""Code-stub prompts: "complete this function" asks built from Python source that is already installed.

HumanEval-style prompts (a signature and its docstring, asked as in `sources.HUMANEVAL_ASK`) teach a
drafter what code answers do most: repeat the prompt's names, signature and docstring. No dataset ships
them here, but every machine has thousands in the Python standard library (and in any installed
package): each public top-level function with a docstring becomes one prompt, cut after its docstring
(the target writes the body). A drafter trained only on chat prompts never sees that copying; on
SmolLM2 it lost HumanEval to prompt lookup, whose best case it is (docs/measurements.md, 2026-12-03).

The chosen stubs (ordered by sha256(seed, stub), the first `count`) are written as a prompt-format
JSONL file (`{"prompt": ...}` per line) in the cache, named by the sha256 of its content, so curate's
source key changes exactly when the prompts do (another Python version, another package version).
Eval prompts such as HumanEval's stay out of training through curate's decontamination, like any
source's. This module knows nothing of curate nor of Prefect.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import logging
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from draftflow.curate_config import CodeStubsConfig
from draftflow.data.sources import HUMANEVAL_ASK
from draftflow.errors import ConfigError, DraftflowError
from draftflow.store import default_cache_dir, write_local_atomic

log = logging.getLogger(__name__)
STDLIB = "stdlib"
# Folders whose code is tests, demos or vendored copies, not the API a user asks about.
SKIP_DIRS = frozenset({"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "dist-packages",
                       "__pycache__", "ensurepip", "_vendor", "vendor"})


def package_root(name: str) -> Path:
    """The folder of the standard library (`stdlib`) or of an installed package (import name).

    Raises:
        ConfigError: the package is not installed or is a single module without a folder.
    """
    if name == STDLIB:
        return Path(sysconfig.get_paths()["stdlib"])
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders:
        raise ConfigError(f"code_stubs.packages names {name}, which is not an installed package with a folder: "
                          f"pip install it, or use '{STDLIB}'")
    return Path(folders[0])


def python_files(root: Path) -> list[Path]:
    """The .py files under `root`, sorted, outside SKIP_DIRS and hidden folders."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        found += [Path(folder) / f for f in files if f.endswith(".py")]
    return sorted(found)


def stubs_in(source: str, cfg: CodeStubsConfig) -> Iterator[str]:
    """Each public top-level function of a module's source, as its `def` line(s) through its docstring.

    A function qualifies when its name has no leading underscore and its docstring has at least
    `min_doc_chars` characters; a stub longer than `max_chars` is skipped, not cut (a cut docstring would
    teach a broken prompt). Decorators are left out. Unparsable source yields nothing.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # Python 2 leftovers, null bytes
        return
    lines = source.splitlines()
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if doc is None or len(doc) < cfg.min_doc_chars:
            continue
        stub = "\n".join(lines[node.lineno - 1:node.body[0].end_lineno]).rstrip() + "\n"
        if len(stub) <= cfg.max_chars:
            yield stub


def collect(cfg: CodeStubsConfig) -> list[str]:
    """Every distinct stub of the configured packages, in file order."""
    seen: dict[str, None] = {}
    for name in cfg.packages:
        for path in python_files(package_root(name)):
            try:
                source = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            seen.update(dict.fromkeys(stubs_in(source, cfg)))
    return list(seen)


def choose(stubs: list[str], count: int, seed: int) -> list[str]:
    """The first `count` stubs ordered by sha256(seed, stub): stable under files being added or removed."""
    def key(stub: str) -> bytes:
        return hashlib.sha256(f"{seed}\0{stub}".encode()).digest()

    return sorted(stubs, key=key)[:count]


def prompts_file(cfg: CodeStubsConfig, cache_dir: Path | None = None) -> str:
    """The local path of the prompts file for this config, written unless the cache holds its content.

    Raises:
        ConfigError: a package is not installed.
        DraftflowError: the packages hold no qualifying function.
    """
    stubs = choose(collect(cfg), cfg.count, cfg.seed)
    if not stubs:
        raise DraftflowError(f"code_stubs: no public function with a docstring of {cfg.min_doc_chars}+ characters "
                             f"in {', '.join(cfg.packages)}; lower code_stubs.min_doc_chars or name other packages")
    if len(stubs) < cfg.count:
        log.warning("code_stubs: %d of %d prompts (the packages hold no more)", len(stubs), cfg.count)
    body = "".join(json.dumps({"prompt": HUMANEVAL_ASK.format(code=s)}, ensure_ascii=False) + "\n" for s in stubs)
    name = hashlib.sha256(body.encode()).hexdigest()[:32]
    path = Path(cache_dir or default_cache_dir()) / "code_stubs" / f"{name}.jsonl"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_local_atomic(path, lambda tmp: Path(tmp).write_text(body, encoding="utf-8"))
        log.info("code_stubs: %d prompts from %s in %s", len(stubs), ", ".join(cfg.packages), path)
    return str(path)
