"""Which eval prompts are decoded: their categories, the `evaluate.categories` filter and a fair cut.

Categories come from curation (`SourceConfig.category` / `category_field`, kept in curate's
`category` column); a row without one counts under its source's name. `check_categories` runs at
preflight, from the config alone, and `select` at the evaluate stage, on the eval rows. What it does
not know: torch, models, stores. Trade-off: preflight can only rule out a category that no source
could give (a `category_field` source could give any name), so `select` checks again on the rows.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from draftflow.config import CurateConfig, EvaluateConfig
from draftflow.errors import ConfigError


def _unknown(name: str, known: Sequence[str], where: str) -> ConfigError:
    return ConfigError(
        f"evaluate.categories names {name!r}, which {where} (categories: {', '.join(known)}); "
        "fix the name, or set category / category_field on the curate source that holds those prompts"
    )


def check_categories(curate: CurateConfig, evaluate: EvaluateConfig) -> None:
    """Before any work: every name in `evaluate.categories` is one a source with eval rows can give.

    A source gives its `category` (else its name); one with `category_field` may give any name, and
    then nothing is ruled out here. Sources with `split: train` give no eval prompt.

    Raises:
        ConfigError: a category no source can give (one line naming the ones they can).
    """
    sources = [s for s in curate.sources if s.split != "train"]
    if not evaluate.categories or any(s.category_field for s in sources):
        return
    known = sorted({s.category or s.name for s in sources})
    for name in evaluate.categories:
        if name not in known:
            raise _unknown(name, known, "no curate source with eval prompts gives")


def row_category(row: dict[str, Any]) -> str:
    """A curated row's category: its `category` column, else its source's name."""
    return row.get("category") or row["source"]


def select(categories: Sequence[str], wanted: list[str] | None, limit: int | None) -> list[int]:
    """Indices of the prompts to decode: those of the `wanted` categories (all when None), interleaved
    category by category (in `wanted`'s order, else by name) and cut at `limit`.

    One category gives the eval order unchanged; several keep a near-equal share each under `limit`.

    Raises:
        ConfigError: a wanted category that no eval prompt has (one line naming the known ones).
    """
    known = sorted(set(categories))
    for name in wanted or []:
        if name not in known:
            raise _unknown(name, known, "no eval prompt has")
    order = list(dict.fromkeys(wanted)) if wanted else known
    queues = [[i for i, c in enumerate(categories) if c == name] for name in order]
    picked: list[int] = []
    for depth in range(max((len(q) for q in queues), default=0)):
        picked += [q[depth] for q in queues if depth < len(q)]
    return picked[:limit] if limit else picked


def prompt_set(sample_ids: Sequence[str]) -> dict[str, Any]:
    """What identifies the prompts decoded: their count and the sha256 of their sample ids in order.

    Two evaluations (e.g. a DFlash and an EAGLE-3 run, read side by side by `draftflow compare`)
    measured identical prompts exactly when these are equal.
    """
    body = json.dumps(list(sample_ids), separators=(",", ":")).encode()
    return {"prompts": len(sample_ids), "sample_ids_sha256": hashlib.sha256(body).hexdigest()}
