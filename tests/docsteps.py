"""The steps a document writes as code blocks, applied to a copy of the repository exactly as written.

A fenced block whose info string names a file is a step (`docs/extending.md`):
  * ```python file=PATH```: PATH is created (or replaced) with the block's text;
  * ```python edit=PATH```: each line `NAME = ...` of the block replaces the line of PATH that starts with
    `NAME =` (exactly one);
  * ```python insert=PATH before='PREFIX'```: the block's lines go in before the one line of PATH that
    starts with PREFIX.
Any other block is prose. A step that cannot apply (no such line, or two) fails, naming the step.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

FENCE = re.compile(r"^```(\S*)([^\n]*)\n(.*?)^```$", re.M | re.S)


def steps(doc: str, section: str) -> list[tuple[dict[str, str], str]]:
    """The steps of the `## section` of markdown `doc`, in order: (options, block text)."""
    start = doc.index(f"## {section}")
    end = doc.find("\n## ", start + 1)
    out = []
    for m in FENCE.finditer(doc[start:end if end > 0 else len(doc)]):
        opts = dict(w.split("=", 1) for w in shlex.split(m.group(2)) if "=" in w)
        if {"file", "edit", "insert"} & set(opts):
            out.append((opts, m.group(3)))
    return out


def _one_line(lines: list[str], prefix: str, where: str) -> int:
    hits = [i for i, line in enumerate(lines) if line.startswith(prefix)]
    assert len(hits) == 1, f"{where}: {len(hits)} lines start with {prefix!r}"
    return hits[0]


def apply(root: Path, found: list[tuple[dict[str, str], str]]) -> set[str]:
    """Apply the steps under `root`; return the paths they touched (relative)."""
    touched = set()
    for opts, text in found:
        rel = opts.get("file") or opts.get("edit") or opts["insert"]
        path = root / rel
        touched.add(rel)
        if "file" in opts:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            continue
        lines = path.read_text().split("\n")
        if "edit" in opts:
            for new in text.rstrip("\n").split("\n"):
                name = new.split("=", 1)[0].rstrip() + " ="
                lines[_one_line(lines, name, rel)] = new
        else:
            at = _one_line(lines, opts["before"], rel)
            lines[at:at] = text.rstrip("\n").split("\n")
        path.write_text("\n".join(lines))
    return touched
