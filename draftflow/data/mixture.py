"""The mixture: how many rows each source contributes, which ones, and the train/eval split.

Everything is decided on 64-bit keys, never on texts: each row's shuffle key
is sha256(seed, sample_id), so the choice of rows and their order depend only
on the config and the content (not on read order or task completion order).

Quotas: a source with `count` keeps at most that many rows. Weighted sources
share `curate.total_rows` (minus the counted sources' quotas) in proportion to
their weights; without `total_rows` they form the largest mixture their
availability allows. A source with neither keeps every row. A source that has
fewer rows than its quota keeps all of them (the shortfall is reported).
"""

from __future__ import annotations

import math

import numpy as np

from draftflow.config import CurateConfig


def _weighted(weights: dict[str, float], available: dict[str, int], total: int | None) -> dict[str, int]:
    if not weights:
        return {}
    wsum = sum(weights.values())
    if total is None:  # the largest mixture with these proportions
        scale = min(available[s] / (w / wsum) for s, w in weights.items())
        return {s: min(available[s], math.floor(scale * w / wsum + 1e-9)) for s, w in weights.items()}
    exact = {s: total * w / wsum for s, w in weights.items()}
    quota = {s: math.floor(v) for s, v in exact.items()}
    # Largest remainders get the rows left by rounding down (ties: config order).
    for s in sorted(exact, key=lambda s: quota[s] - exact[s])[: total - sum(quota.values())]:
        quota[s] += 1
    return quota


def quotas(cfg: CurateConfig, available: dict[str, int]) -> dict[str, int]:
    """Target rows per source (before capping at what is available)."""
    counts = {s.name: s.count for s in cfg.sources if s.count is not None}
    weights = {s.name: s.weight for s in cfg.sources if s.weight is not None}
    total = None if cfg.total_rows is None else max(0, cfg.total_rows - sum(counts.values()))
    out = {s.name: available.get(s.name, 0) for s in cfg.sources}
    out.update(counts)
    out.update(_weighted(weights, {s: available.get(s, 0) for s in weights}, total))
    return out


def select(order: np.ndarray, source: np.ndarray, alive: np.ndarray, quota: list[int]) -> np.ndarray:
    """Mask of the rows kept: per source, the first `quota[s]` alive rows by shuffle key.

    Args:
        order: (n,) uint64 shuffle keys.
        source: (n,) source index of each row.
        alive: (n,) rows still in the running (not rejected or duplicated).
        quota: rows wanted per source index.
    """
    keep = np.zeros(len(order), dtype=bool)
    for s, q in enumerate(quota):
        idx = np.flatnonzero(alive & (source == s))
        keep[idx[np.lexsort((idx, order[idx]))[:q]]] = True
    return keep


def shuffle_and_split(order: np.ndarray, keep: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train row indices, eval row indices), both in shuffled order; eval is the first share."""
    idx = np.flatnonzero(keep)
    idx = idx[np.lexsort((idx, order[idx]))]
    n_eval = round(len(idx) * eval_fraction)
    if eval_fraction > 0 and len(idx) > 1:
        n_eval = max(1, n_eval)
    return idx[n_eval:], idx[:n_eval]


def split_rows(order: np.ndarray, keep: np.ndarray, source: np.ndarray, fixed: dict[int, str],
               eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Like `shuffle_and_split`, but rows of a source with a fixed split (`SourceConfig.split`, source index ->
    "train" | "eval") all go there; only the other rows are split by `eval_fraction`.

    Both outputs stay in shuffle-key order, so without fixed sources this equals `shuffle_and_split`, and
    adding an eval-only source leaves the other sources' train/eval split unchanged.
    """
    pinned = np.isin(source, list(fixed)) if fixed else np.zeros(len(order), bool)
    train, evals = shuffle_and_split(order, keep & ~pinned, eval_fraction)
    out = {"train": [train], "eval": [evals]}
    for s, split in fixed.items():
        out[split].append(np.flatnonzero(keep & (source == s)))
    merged = []
    for split in ("train", "eval"):
        idx = np.concatenate(out[split]).astype(np.int64)
        merged.append(idx[np.lexsort((idx, order[idx]))])
    return merged[0], merged[1]
