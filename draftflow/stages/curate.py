"""Curate: raw sources -> clean, deduplicated, mixed, shuffled, split conversations.

Two steps, so the expensive one runs in parallel:

1. scan (one unit of work per part: a source's file, a group of its files, or
   an hf dataset): read, convert, filter, key; write a partial shard under
   `parts/` and a rejects shard (`data/scan.py`).
2. merge (one unit): exact dedup, MinHash near-dup, mixture quotas, shuffle and
   train/eval split, all on 64-bit keys and signatures (`data/dedup.py`,
   `data/mixture.py`); then the kept rows are copied from the partials into
   fixed-size shards, a bounded group of output shards per pass. It writes the
   per-source statistics, a PNG histogram and the manifest, then drops `parts/`.

Determinism: the first row in (part, row) order wins a duplicate; the shuffle
key is sha256(seed, sample_id); so the same config and sources give
byte-identical shards however the scans are scheduled.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from draftflow.config import CurateConfig, RunConfig, SourceConfig
from draftflow.contracts import Manifest, ShardEntry, ShardResult, SourcePart
from draftflow.data import dedup, mixture, stats
from draftflow.data.filters import needs_tokens
from draftflow.data.readers import check_source, file_keys, source_files, source_key
from draftflow.data.scan import scan_local
from draftflow.data.schema import CURATED
from draftflow.errors import ConfigError, DraftflowError
from draftflow.stages.common import finalize
from draftflow.store import Store, digest, shard_entry

log = logging.getLogger(__name__)
STAGE = "curate"
PARTS = "parts"
MAX_PARTS = 64  # scan units per stage: Prefect task runs stay in the tens
MERGE_BUDGET_BYTES = 512 << 20  # partial data held while writing one group of output shards
PNG = "prompt_lengths.png"
OUT_COLUMNS = ["sample_id", "source", "messages", "tools", "category"]


def check_sources(cfg: CurateConfig) -> None:
    """Raise `SourceError` naming the first source that cannot be reached (before any work)."""
    if not cfg.sources:
        raise ConfigError("curate.sources is empty; list at least one source with a name and a path")
    names = [s.name for s in cfg.sources]
    if len(set(names)) != len(names):
        raise ConfigError(f"curate.sources names must be unique: {names}")
    for src in cfg.sources:
        check_source(src)


def source_keys(cfg: CurateConfig) -> dict[str, str]:
    """A content key per source (its files' fsspec `ukey`s; hf: name/config/split).

    Part of curate's fingerprint, so editing a source file in place re-runs curation.
    """
    return {src.name: source_key(src) for src in cfg.sources}


def stage_inputs(cfg: RunConfig) -> tuple[dict[str, str], str | None]:
    """(curate's fingerprint inputs, the tokenizer path for token bounds or None).

    Raises `SourceError` for a source that cannot be reached: this runs first, before any work.
    """
    check_sources(cfg.curate)
    return source_fingerprint_inputs(cfg), token_counter(cfg)


def token_counter(cfg: RunConfig) -> str | None:
    """The tokenizer that counts tokens for the token bounds: `curate.tokenizer`, else the target's
    (None without token bounds)."""
    if not needs_tokens(cfg.curate):
        return None
    if cfg.curate.tokenizer is not None:
        return cfg.curate.tokenizer
    from draftflow.target import resolve_target

    return resolve_target(cfg.target).path


def source_fingerprint_inputs(cfg: RunConfig) -> dict[str, str]:
    """Curate's fingerprint inputs: the sources' content keys, and, when token bounds count with the
    target's tokenizer (no `curate.tokenizer`), the target's fingerprint."""
    inputs = {"sources": digest(source_keys(cfg.curate))}
    if needs_tokens(cfg.curate) and cfg.curate.tokenizer is None:
        from draftflow.target import resolve_target

        inputs["tokenizer"] = resolve_target(cfg.target).fingerprint
    return inputs


def _part(src: SourceConfig, index: int, files: list[str]) -> SourcePart:
    import fsspec

    sizes = [fsspec.core.url_to_fs(f)[0].size(fsspec.core.url_to_fs(f)[1]) or 0 for f in files]
    content = source_key(src) if src.hf else list(zip(files, file_keys(files)))
    return SourcePart(name=f"part-{index:05d}", source=src.name, files=tuple(files), bytes=sum(sizes),
                      sha256=digest({"source": src.model_dump(mode="json"), "content": content}))


def plan_parts(cfg: CurateConfig) -> list[SourcePart]:
    """The scan units: contiguous groups of each source's files (one per hf source).

    Each part has a `name`, its `source`, `files`, `bytes`, and a `sha256` that
    stands for its content (a cache key, never a path or a time).
    """
    per_source = max(1, MAX_PARTS // len(cfg.sources))
    parts: list[SourcePart] = []
    for src in cfg.sources:
        files = source_files(src)
        n = max(1, min(per_source, len(files)))
        for i in range(n):
            parts.append(_part(src, len(parts), files[i * len(files) // n:(i + 1) * len(files) // n]))
    return parts


def _source(cfg: CurateConfig, name: str) -> SourceConfig:
    return next(s for s in cfg.sources if s.name == name)


def _commit(store: Store, fp: str, name: str, local: str, rows: int, **extra: Any) -> ShardEntry:
    with store.writing(store.stage_path(STAGE, fp, name)) as tmp:
        shutil.copyfile(local, tmp)
        return shard_entry(name, tmp, rows=rows, **extra)


def scan_part(store: Store, fp: str, cfg: RunConfig, part: SourcePart, tokenizer: str | None = None
              ) -> ShardResult:
    """Scan one part into `parts/<name>.parquet` (+ its rejects); return the entries and counts
    (`info`: the part's name and source)."""
    src = _source(cfg.curate, part.source)
    out, rej, counts = scan_local(cfg.curate, src, list(part.files), tokenizer or cfg.curate.tokenizer)
    try:
        entry = _commit(store, fp, f"{PARTS}/{part.name}.parquet", out, counts["rows_out"])
        rejected = _commit(store, fp, f"rejected-curate-{part.name[5:]}.parquet", rej, counts["rejects"]) \
            if rej else None
    finally:
        shutil.rmtree(os.path.dirname(out), ignore_errors=True)
    return ShardResult(shard=entry, rejected=rejected, rows_in=counts["rows_in"], rows_out=counts["rows_out"],
                       dropped=dict(counts["dropped"]), info={"part": part.name, "source": src.name})


def _scan_in_child(root: str, fp: str, cfg: RunConfig, part: SourcePart, tokenizer: str | None) -> ShardResult:
    return scan_part(Store(root), fp, cfg, part, tokenizer)


def scan_part_isolated(store: Store, fp: str, cfg: RunConfig, part: SourcePart, tokenizer: str | None = None,
                       min_bytes: int = 16 << 20) -> ShardResult:
    """`scan_part` in a fresh process when the part is big (parsing holds the GIL; threads would not scale)."""
    if part.bytes < min_bytes:
        return scan_part(store, fp, cfg, part, tokenizer)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_scan_in_child, store.root, fp, cfg, part, tokenizer).result()


def load_keys(store: Store, fp: str, cfg: CurateConfig, scans: list[ShardResult]) -> dict[str, np.ndarray]:
    """The merge's view of every scanned row: digests and lengths, never texts."""
    n = sum(s.rows_out for s in scans)
    near = cfg.near_dup_threshold is not None
    keys = {"prompt_key": np.empty(n, np.uint64), "order_key": np.empty(n, np.uint64),
            "chars": np.empty(n, np.int32), "source": np.empty(n, np.int16), "offsets": np.zeros(len(scans) + 1, int)}
    if near:
        keys["minhash"] = np.empty((n, dedup.NUM_PERM), np.uint32)
    names = {s.name: i for i, s in enumerate(cfg.sources)}
    at = 0
    for p, s in enumerate(scans):
        cols = ["prompt_key", "order_key", "prompt_chars"] + (["minhash"] if near else [])
        t = pq.read_table(store.verify_sha(STAGE, fp, s.shard), columns=cols)
        end = at + t.num_rows
        keys["prompt_key"][at:end] = t["prompt_key"].to_numpy()
        keys["order_key"][at:end] = t["order_key"].to_numpy()
        keys["chars"][at:end] = t["prompt_chars"].to_numpy()
        keys["source"][at:end] = names[s.info["source"]]
        if near and t.num_rows:
            sig = t["minhash"].combine_chunks()
            keys["minhash"][at:end] = np.frombuffer(sig.buffers()[1], "<u4").reshape(-1, dedup.NUM_PERM)[:t.num_rows]
        at = keys["offsets"][p + 1] = end
    return keys


def decide(cfg: CurateConfig, keys: dict[str, np.ndarray]) -> dict[str, Any]:
    """Dedup, near-dup, mixture, shuffle and split on the keys; returns masks and row orders."""
    n = len(keys["prompt_key"])
    exact = ~dedup.first_occurrence(keys["prompt_key"])
    near = np.zeros(n, bool)
    anchor, sim = np.full(n, -1), np.zeros(n, np.float32)
    if cfg.near_dup_threshold is not None:
        live = np.flatnonzero(~exact)
        mask, a, s = dedup.near_duplicates(keys["minhash"][live], cfg.near_dup_threshold)
        near[live[mask]], anchor[live[mask]], sim[live[mask]] = True, live[a[mask]], s[mask]
    alive = ~exact & ~near
    available = {src.name: int(np.sum(alive & (keys["source"] == i))) for i, src in enumerate(cfg.sources)}
    quota = mixture.quotas(cfg, available)
    keep = mixture.select(keys["order_key"], keys["source"], alive, [quota[s.name] for s in cfg.sources])
    fixed = {i: src.split for i, src in enumerate(cfg.sources) if src.split}  # eval-only / train-only sources
    train, evals = mixture.split_rows(keys["order_key"], keep, keys["source"], fixed, cfg.eval_fraction)
    return {"duplicate": exact, "near_duplicate": near, "mixture_cap": alive & ~keep, "keep": keep,
            "anchor": anchor, "similarity": sim, "train": train, "eval": evals, "available": available,
            "quota": quota}


def _shard_plan(n_train: int, n_eval: int, size: int) -> list[tuple[str, str, int, int]]:
    """(name, split, start, stop) over positions: train rows first, then eval rows."""
    plan = []
    for split, base, count in (("train", 0, n_train), ("eval", n_train, n_eval)):
        for i in range(0, count, size):
            plan.append((f"{split}-{i // size:05d}.parquet", split, base + i, base + min(i + size, count)))
    return plan


def _groups(plan: list[tuple], row_bytes: float) -> list[list[tuple]]:
    """Consecutive output shards whose rows fit the merge budget together."""
    groups: list[list[tuple]] = [[]]
    for shard in plan:
        rows = sum(s[3] - s[2] for s in groups[-1])
        if groups[-1] and (rows + shard[3] - shard[2]) * row_bytes > MERGE_BUDGET_BYTES:
            groups.append([])
        groups[-1].append(shard)
    return [g for g in groups if g]


def _row_bytes(paths: list[str]) -> float:
    """Uncompressed bytes per partial row (all columns: an over-estimate of what is held)."""
    size = rows = 0
    for path in paths:
        meta = pq.ParquetFile(path).metadata
        rows += meta.num_rows
        size += sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    return size / max(1, rows)


def _gather(paths: list[str], offsets: np.ndarray, pos: np.ndarray, a: int, b: int) -> pa.Table:
    """The output rows at positions [a, b), in position order, streamed from the partials."""
    pieces, where = [], []
    for p, path in enumerate(paths):
        local = pos[offsets[p]:offsets[p + 1]]
        if not np.any((local >= a) & (local < b)):
            continue
        start = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=8192, columns=OUT_COLUMNS):
            sel = np.flatnonzero((local[start:start + batch.num_rows] >= a) & (local[start:start + batch.num_rows] < b))
            if len(sel):
                pieces.append(batch.take(pa.array(sel)))
                where.append(local[start + sel])
            start += batch.num_rows
    table = pa.Table.from_batches(pieces)
    return table.take(pa.array(np.argsort(np.concatenate(where), kind="stable")))


def write_outputs(store: Store, fp: str, cfg: CurateConfig, scans: list[ShardResult], keys: dict,
                  plan_: dict) -> list[ShardEntry]:
    """Copy the kept rows into fixed-size shards, shuffled, one bounded group of shards at a time."""
    paths = [store.verify_sha(STAGE, fp, s.shard) for s in scans]
    seq = np.concatenate([plan_["train"], plan_["eval"]])
    pos = np.full(len(keys["order_key"]), -1, np.int64)
    pos[seq] = np.arange(len(seq))
    row_bytes = _row_bytes(paths)
    entries = []
    for group in _groups(_shard_plan(len(plan_["train"]), len(plan_["eval"]), cfg.shard_rows), row_bytes):
        table = _gather(paths, keys["offsets"], pos, group[0][2], group[-1][3])
        for name, split, start, stop in group:
            part = table.slice(start - group[0][2], stop - start)
            out = pa.table({"sample_id": part["sample_id"], "source": part["source"],
                            "split": pa.array([split] * part.num_rows, pa.string()), "messages": part["messages"],
                            "tools": part["tools"], "category": part["category"]}).cast(CURATED).combine_chunks()
            with store.writing(store.stage_path(STAGE, fp, name)) as tmp:
                pq.write_table(out, tmp, compression="zstd")
                entries.append(shard_entry(name, tmp, rows=out.num_rows, split=split))
    return entries


def _per_source(cfg: CurateConfig, scans: list[ShardResult], keys: dict, plan_: dict) -> dict[str, dict[str, Any]]:
    out = {}
    for i, src in enumerate(cfg.sources):
        mine = keys["source"] == i
        dropped: Counter = Counter()
        for s in scans:
            if s.info["source"] == src.name:
                dropped.update(s.dropped)
        for reason in ("duplicate", "near_duplicate", "mixture_cap"):
            if n := int(np.sum(plan_[reason] & mine)):
                dropped[reason] += n
        read = sum(s.rows_in for s in scans if s.info["source"] == src.name)
        out[src.name] = stats.source_stats(read, dropped, int(np.sum(plan_["keep"] & mine)),
                                           keys["chars"][plan_["keep"] & mine])
        out[src.name]["mixture"] = {"available": plan_["available"][src.name], "quota": plan_["quota"][src.name]}
    return out


def _previews(paths: list[str], offsets: np.ndarray, rows: list[int]) -> dict[int, str]:
    """The stored prompt previews of a few rows (by global index)."""
    found: dict[int, str] = {}
    for row in rows:
        p = int(np.searchsorted(offsets, row, side="right") - 1)
        table = pq.read_table(paths[p], columns=["preview", "source", "sample_id"]).slice(row - offsets[p], 1)
        found[row] = {k: table[k][0].as_py() for k in ("source", "sample_id", "preview")}
    return found


def near_dup_report(cfg: CurateConfig, paths: list[str], keys: dict, plan_: dict, limit: int = 5) -> dict:
    """How many near duplicates were removed, with a few (row, the row it resembles) examples."""
    if cfg.near_dup_threshold is None:
        return {"threshold": None, "removed": 0, "examples": []}
    rows = np.flatnonzero(plan_["near_duplicate"])[:limit].tolist()
    anchors = [int(plan_["anchor"][r]) for r in rows]
    text = _previews(paths, keys["offsets"], rows + anchors)
    examples = [{"removed": text[r], "kept": text[a], "similarity": round(float(plan_["similarity"][r]), 3)}
                for r, a in zip(rows, anchors)]
    return {"threshold": cfg.near_dup_threshold, "removed": int(plan_["near_duplicate"].sum()), "examples": examples}


def _write_png(store: Store, fp: str, per_source: dict) -> str | None:
    try:
        with store.writing(store.stage_path(STAGE, fp, PNG)) as tmp:
            stats.draw_histograms(tmp, per_source)
    except ImportError:
        log.warning("matplotlib is not installed; skipping %s", PNG)
        return None
    return PNG


def merge(store: Store, fp: str, cfg: RunConfig, inputs: dict[str, str], scans: list[ShardResult]) -> Manifest:
    """Decide and write the curated set from the scans' partials; write the manifest (last)."""
    ccfg = cfg.curate
    scans = sorted(scans, key=lambda s: s.info["part"])
    keys = load_keys(store, fp, ccfg, scans)
    plan_ = decide(ccfg, keys)
    dropped: Counter = Counter()
    for s in scans:
        dropped.update(s.dropped)
    dropped.update({r: int(plan_[r].sum()) for r in ("duplicate", "near_duplicate", "mixture_cap") if plan_[r].any()})
    rows_in = sum(s.rows_in for s in scans)
    if not len(plan_["train"]):
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(dropped.items())) or "none"
        raise DraftflowError(f"curate kept no training conversations from {rows_in} rows "
                             f"(dropped: {reasons}); check curate.sources and their format")
    entries = write_outputs(store, fp, ccfg, scans, keys, plan_)
    paths = [store.verify_sha(STAGE, fp, s.shard) for s in scans]
    per_source = _per_source(ccfg, scans, keys, plan_)
    extra = {"sources": per_source, "near_duplicates": near_dup_report(ccfg, paths, keys, plan_),
             "histogram_bins": stats.bin_labels(), "histogram_png": _write_png(store, fp, per_source),
             "kept_per_source": {k: v["kept"] for k, v in per_source.items() if v["kept"]},
             "parts": len(scans)}
    results = [ShardResult(shard=None, rows_in=rows_in, rows_out=int(plan_["keep"].sum()), dropped=dict(dropped))]
    results += [ShardResult(shard=None, rejected=s.rejected, rows_in=0, rows_out=0) for s in scans if s.rejected]
    results += [ShardResult(shard=e, rows_in=0, rows_out=0) for e in entries]
    manifest = finalize(store, STAGE, fp, cfg, inputs, results, extra=extra)
    parts = store.stage_path(STAGE, fp, PARTS)
    if store.exists(parts):
        store.fs.rm(parts, recursive=True)  # scan tasks rebuild a missing partial if they are ever run again
    return manifest


def run(store: Store, fp: str, cfg: RunConfig, inputs: dict[str, str], tokenizer: str | None = None,
        workers: int = 1) -> Manifest:
    """Run curation in this process (scans over `workers` processes); return the manifest.

    Args:
        tokenizer: tokenizer path for token-length bounds (default: `curate.tokenizer`).
        workers: processes scanning parts at once (1: scan here, in order).
    """
    check_sources(cfg.curate)
    parts = plan_parts(cfg.curate)
    if workers <= 1 or len(parts) == 1:
        scans = [scan_part(store, fp, cfg, p, tokenizer) for p in parts]
    else:
        with ProcessPoolExecutor(min(workers, len(parts)), mp_context=multiprocessing.get_context("spawn")) as pool:
            n = len(parts)
            scans = list(pool.map(_scan_in_child, [store.root] * n, [fp] * n, [cfg] * n, parts, [tokenizer] * n))
    return merge(store, fp, cfg, inputs, scans)
