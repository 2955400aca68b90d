"""Which scanned rows the curate merge keeps, decided on digests only (never texts).

In order: exact dedup (first row wins, rows of eval-only sources first), MinHash near-dup (same
preference), mixture quotas, shuffle and train/eval split, then decontamination: a train row whose
prompt copies an eval row's, or (with `curate.decontaminate`) whose MinHash similarity to an eval row
reaches the threshold, goes with reason `eval_overlap`. Decontamination runs after the split because only
then is the eval set known; the rows it drops are not replaced from the mixture (quotas are upper bounds).
The stage (stages/curate.py) loads the keys and writes what is decided here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from draftflow.config import CurateConfig
from draftflow.data import dedup, mixture

MERGE_REASONS = ("duplicate", "near_duplicate", "mixture_cap", "eval_overlap")  # drop reasons decided here


def _near(cfg: CurateConfig, keys: dict[str, np.ndarray], exact: np.ndarray, preferred: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(near duplicates, the row each resembles or -1, similarity) among the rows left by exact dedup."""
    n = len(exact)
    near, anchor, sim = np.zeros(n, bool), np.full(n, -1), np.zeros(n, np.float32)
    if cfg.near_dup_threshold is not None:
        live = np.flatnonzero(~exact)
        live = live[np.argsort(~preferred[live], kind="stable")]  # preferred rows first: they are kept
        mask, a, s = dedup.near_duplicates(keys["minhash"][live], cfg.near_dup_threshold)
        near[live[mask]], anchor[live[mask]], sim[live[mask]] = True, live[a[mask]], s[mask]
    return near, anchor, sim


def eval_overlap(cfg: CurateConfig, keys: dict[str, np.ndarray], train: np.ndarray, evals: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Train rows that copy an eval row's prompt, or (with `curate.decontaminate`) nearly copy it.

    Returns:
        (mask over `train`, the eval row each one resembles (-1 if none), similarity)
    """
    hit, anchor, sim = np.zeros(len(train), bool), np.full(len(train), -1), np.zeros(len(train), np.float32)
    if not len(train) or not len(evals):
        return hit, anchor, sim
    eval_keys = keys["prompt_key"][evals]
    hit = np.isin(keys["prompt_key"][train], eval_keys)  # none after exact dedup: checked as the contract
    if hit.any():
        by_key = dict(zip(eval_keys.tolist(), evals.tolist()))
        anchor[hit], sim[hit] = [by_key[k] for k in keys["prompt_key"][train[hit]].tolist()], 1.0
    if cfg.decontaminate is not None:
        mask, a, s = dedup.near_matches(keys["minhash"][train], keys["minhash"][evals], cfg.decontaminate)
        new = mask & ~hit
        hit[new], anchor[new], sim[new] = True, evals[a[new]], s[new]
    return hit, anchor, sim


def decide(cfg: CurateConfig, keys: dict[str, np.ndarray]) -> dict[str, Any]:
    """Dedup, near-dup, mixture, shuffle, split and decontamination on the keys; returns masks and row orders
    (`anchor`/`similarity`: the row a near duplicate or an eval-overlapping train row resembles)."""
    pinned_eval = np.isin(keys["source"], [i for i, s in enumerate(cfg.sources) if s.split == "eval"])
    exact = ~dedup.first_occurrence(keys["prompt_key"], pinned_eval)
    near, anchor, sim = _near(cfg, keys, exact, pinned_eval)
    alive = ~exact & ~near
    available = {src.name: int(np.sum(alive & (keys["source"] == i))) for i, src in enumerate(cfg.sources)}
    quota = mixture.quotas(cfg, available)
    picked = mixture.select(keys["order_key"], keys["source"], alive, [quota[s.name] for s in cfg.sources])
    fixed = {i: src.split for i, src in enumerate(cfg.sources) if src.split}  # eval-only / train-only sources
    train, evals = mixture.split_rows(keys["order_key"], picked, keys["source"], fixed, cfg.eval_fraction)
    hit, a, s = eval_overlap(cfg, keys, train, evals)
    overlap = np.zeros(len(exact), bool)
    overlap[train[hit]], anchor[train[hit]], sim[train[hit]] = True, a[hit], s[hit]
    return {"duplicate": exact, "near_duplicate": near, "mixture_cap": alive & ~picked, "eval_overlap": overlap,
            "keep": picked & ~overlap, "anchor": anchor, "similarity": sim, "train": train[~hit], "eval": evals,
            "available": available, "quota": quota}
