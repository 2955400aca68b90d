"""Exact and near-duplicate detection over digests, never over texts.

Exact: a 64-bit key of the whitespace-normalized system+user text (a collision
among 1M prompts has probability ~3e-8); the first row in read order wins, or
the first preferred row (curate prefers eval-only sources' rows, so an eval
prompt is never the copy that goes).
Near: a MinHash signature (datasketch, 64 permutations of 32 bits) of the
prompt's lower-cased word n-grams, computed where rows are read; the merge
bands the signatures (LSH) with numpy and confirms each candidate by its
estimated Jaccard similarity. State at 1M rows: 8 bytes per row for exact
dedup and 256 bytes per row for the signatures, whatever the text length.

The near-dup rule, chosen for determinism and one pass per band: a row is a
near duplicate when its estimated similarity to the earliest row of an LSH
bucket it shares is at least the threshold (clusters keep their first row).
`near_matches` applies the same rule across two sets (train rows against the
eval split: decontamination).
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from functools import lru_cache
from typing import Any

import numpy as np

NUM_PERM = 64
_WORD = re.compile(r"\w+")
_MIX = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5,
                 0x85EBCA77C2B2AE63, 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x94D049BB133111EB], dtype=np.uint64)


def key64(text: str) -> int:
    """The first 8 bytes of sha256(text) as an unsigned int (big-endian: sorts like the digest)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def prompt_key(messages: list[dict[str, Any]]) -> int:
    """Exact-duplicate key: the system and user texts, whitespace-normalized."""
    parts = [(m["role"], " ".join(m["content"].split())) for m in messages if m["role"] in ("system", "user")]
    return key64(json.dumps(parts, ensure_ascii=False))


def order_key(seed: int, sample_id: str) -> int:
    """The deterministic shuffle position of a sample: sha256 of (seed, id)."""
    return key64(f"{seed}:{sample_id}")


def first_occurrence(keys: np.ndarray, preferred: np.ndarray | None = None) -> np.ndarray:
    """Boolean mask of the rows whose key has not been seen earlier in the array.

    Args:
        preferred: (n,) bool; these rows count as earlier than all the others (then array order).
    """
    order = np.arange(len(keys)) if preferred is None else np.argsort(~preferred, kind="stable")
    keep = np.zeros(len(keys), dtype=bool)
    keep[order[np.unique(keys[order], return_index=True)[1]]] = True
    return keep


@lru_cache(maxsize=1)
def _template():
    from datasketch import MinHash

    return MinHash(num_perm=NUM_PERM, hashfunc=zlib.crc32)


def shingles(text: str, n: int) -> list[bytes]:
    """Word n-grams of the lower-cased text, punctuation ignored."""
    words = _WORD.findall(text.lower())
    if len(words) <= n:
        return [" ".join(words).encode()]
    return [" ".join(words[i:i + n]).encode() for i in range(len(words) - n + 1)]


def signature(text: str, ngram: int) -> bytes:
    """MinHash signature of the text's word n-grams: NUM_PERM uint32 values as bytes."""
    from datasketch import MinHash

    t = _template()
    m = MinHash(num_perm=NUM_PERM, hashfunc=zlib.crc32, permutations=t.permutations, scheme=t.scheme)
    m.update_batch(shingles(text, ngram))
    return m.hashvalues.astype("<u4").tobytes()


def bands_for(threshold: float, num_perm: int = NUM_PERM) -> tuple[int, int]:
    """(bands, rows per band): the longest bands that still find 97% of pairs at the threshold."""
    for r in range(num_perm, 0, -1):
        b = num_perm // r
        if 1.0 - (1.0 - threshold ** r) ** b >= 0.97:
            return b, r
    return num_perm, 1


def _band_hash(sigs: np.ndarray, band: int, r: int) -> np.ndarray:
    """(n,) uint64 hash of one band of r signature values (collisions only add candidates)."""
    values = sigs[:, band * r:(band + 1) * r].astype(np.uint64)
    with np.errstate(over="ignore"):
        return (values * np.resize(_MIX, r)).sum(axis=1) ^ (values[:, 0] << np.uint64(32))


def near_duplicates(sigs: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Near duplicates among rows in read order.

    Args:
        sigs: (n, NUM_PERM) uint32 signatures.
        threshold: estimated Jaccard similarity at or above which a row is a near duplicate.
    Returns:
        (mask of near duplicates, index of the row each one resembles (-1 if none), similarity)
    """
    n = len(sigs)
    anchor = np.full(n, -1, dtype=np.int64)
    best = np.zeros(n, dtype=np.float32)
    if n < 2:
        return anchor >= 0, anchor, best
    b, r = bands_for(threshold, sigs.shape[1])
    idx = np.arange(n)
    for band in range(b):
        h = _band_hash(sigs, band, r)
        order = np.lexsort((idx, h))
        starts = np.r_[True, h[order][1:] != h[order][:-1]]
        first = order[np.maximum.accumulate(np.where(starts, np.arange(n), 0))]
        cand = order[first != order]  # rows sharing this band's bucket with an earlier row
        if not len(cand):
            continue
        ref = first[first != order]
        sim = (sigs[cand] == sigs[ref]).mean(axis=1).astype(np.float32)
        hit = (sim >= threshold) & (anchor[cand] < 0)
        anchor[cand[hit]], best[cand[hit]] = ref[hit], sim[hit]
    return anchor >= 0, anchor, best


def near_matches(sigs: np.ndarray, refs: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of `sigs` that resemble a row of `refs`: per LSH band, the earliest ref row sharing a row's bucket
    is a candidate, confirmed when their signatures agree on at least `threshold` of their values.

    Returns:
        (mask over `sigs`, index into `refs` of the row each one resembles (-1 if none), similarity)
    """
    anchor = np.full(len(sigs), -1, dtype=np.int64)
    best = np.zeros(len(sigs), dtype=np.float32)
    if not len(sigs) or not len(refs):
        return anchor >= 0, anchor, best
    b, r = bands_for(threshold, sigs.shape[1])
    for band in range(b):
        buckets, first = np.unique(_band_hash(refs, band, r), return_index=True)  # earliest ref per bucket
        h = _band_hash(sigs, band, r)
        at = np.minimum(np.searchsorted(buckets, h), len(buckets) - 1)
        cand = np.flatnonzero((buckets[at] == h) & (anchor < 0))
        ref = first[at[cand]]
        sim = (sigs[cand] == refs[ref]).mean(axis=1).astype(np.float32)
        hit = sim >= threshold
        anchor[cand[hit]], best[cand[hit]] = ref[hit], sim[hit]
    return anchor >= 0, anchor, best


def needs_signatures(cfg: Any) -> bool:
    """Whether curate computes MinHash signatures (a `CurateConfig` with near-dup on, or decontamination on
    and an eval split to protect)."""
    has_eval = cfg.eval_fraction > 0 or any(s.split == "eval" for s in cfg.sources)
    return cfg.near_dup_threshold is not None or (cfg.decontaminate is not None and has_eval)
