"""Config files: YAML read with one-line errors (line and column), `base:` chains merged, and relative
source paths resolved against the file. What a section's default kind is, the caller says (`default_kind`).

What it does not know: the config's fields (`draftflow.config` validates).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from draftflow.errors import ConfigError


def read_yaml(p: Path, chain: tuple[Path, ...], default_kind: Callable[[str], Any]) -> dict[str, Any]:
    """One config file as data, its relative source paths resolved; `base: other.yaml` (relative to this
    file) is read first and this file's keys laid over it (sections merge, lists and values replace)."""
    if not p.is_file():
        raise ConfigError(f"config file not found: {p} (give a path such as configs/tiny.yaml)")
    if p.resolve() in chain:
        raise ConfigError(f"config file {p} is its own base (through {' -> '.join(map(str, chain))}); break the loop")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {p} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                          f"{exc.start}); save it as UTF-8") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {p} is not valid YAML: {_yaml_problem(exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping at the top level")
    _resolve_source_paths(data, p.parent)
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"config file {p}: base must be a file name such as tiny.yaml, not {base!r}")
    return _merged(read_yaml(p.parent / base, (*chain, p.resolve()), default_kind), data, default_kind)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """'<problem> at line L, column C' (1-based, where the parser stopped), else the error's first line."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if mark is None:
        return problem
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"


def _merged(base: dict[str, Any], over: dict[str, Any], default_kind: Callable[[str], Any], top: bool = True
            ) -> dict[str, Any]:
    """`over` laid over `base`: sections merge, lists and values replace; a top-level section whose `kind`
    changes (drafter: dflash -> eagle3) is replaced, so one kind's fields never leak into another's."""
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        if both and top and "kind" in value and value["kind"] != out[key].get("kind", default_kind(key)):
            both = False
        out[key] = _merged(out[key], value, default_kind, top=False) if both else value
    return out


def _resolve_source_paths(data: dict[str, Any], base: Path) -> None:
    """Relative local source paths (and `refresh.traffic`) are relative to the config file (else the working
    directory)."""
    for src in (data.get("curate") or {}).get("sources") or []:
        path = src.get("path") if isinstance(src, dict) else None
        if not path or "://" in path or Path(path).is_absolute() or src.get("package"):
            continue
        candidate = (base / path).resolve()
        if candidate.exists():
            src["path"] = str(candidate)
    traffic = data["refresh"].get("traffic") if isinstance(data.get("refresh"), dict) else None
    if isinstance(traffic, str) and "://" not in traffic and not Path(traffic).is_absolute():
        data["refresh"]["traffic"] = str((base / traffic).resolve())  # a log folder may not exist yet
