"""Curate: raw sources -> clean, deduplicated, shuffled, split conversations.

Reads every configured source (JSONL or parquet, ShareGPT / OpenAI messages /
Alpaca shapes), converts rows to the canonical schema, rejects bad rows with a
reason, drops exact duplicates of the prompt, gives each conversation a stable
id, shuffles deterministically by seed and splits train/eval. Same config and
sources give byte-identical shards. Curation needs a global view (dedup), so it
is one unit of work; the readers stream, so memory holds only kept rows.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from typing import Any

from draftflow.config import CurateConfig, RunConfig
from draftflow.data.schema import CONVERSATION, sample_id
from draftflow.data.sources import BadRow, check_source, read_source, to_messages
from draftflow.errors import ConfigError, DraftflowError
from draftflow.stages.common import finalize, reject, write_parquet, write_rejects
from draftflow.store import Store

STAGE = "curate"


def check_sources(cfg: CurateConfig) -> None:
    """Raise `SourceError` naming the first source that cannot be reached."""
    if not cfg.sources:
        raise ConfigError("curate.sources is empty; list at least one source with a name and a path")
    for src in cfg.sources:
        check_source(src)


def source_keys(cfg: CurateConfig) -> dict[str, str]:
    """A content key per source (fsspec `ukey`: size+mtime locally, ETag on S3).

    Part of curate's fingerprint, so editing a source file in place re-runs curation.
    """
    import fsspec

    keys = {}
    for src in cfg.sources:
        fs, path = fsspec.core.url_to_fs(src.path)
        keys[src.name] = str(fs.ukey(path))
    return keys


def validate_conversation(messages: list[dict[str, Any]]) -> None:
    """Raise `BadRow` for conversations no later stage could use."""
    users = [m for m in messages if m["role"] == "user"]
    if not users:
        raise BadRow("no_user_turn", "the conversation has no user message")
    if not any(m["content"].strip() for m in users):
        raise BadRow("empty_prompt", "every user message is empty or whitespace")


def prompt_key(messages: list[dict[str, Any]]) -> str:
    """Exact-duplicate key: the system and user texts, whitespace-normalized."""
    parts = [(m["role"], " ".join(m["content"].split())) for m in messages if m["role"] in ("system", "user")]
    return hashlib.sha256(json.dumps(parts, ensure_ascii=False).encode()).hexdigest()


def collect(cfg: CurateConfig) -> tuple[list[dict], list[dict], Counter, int]:
    """Read, convert, validate and deduplicate every source.

    Returns:
        (kept rows, rejected rows, dropped counts by reason, rows read)
    """
    kept: list[dict] = []
    rejects: list[dict] = []
    dropped: Counter = Counter()
    seen: set[str] = set()
    rows_in = 0
    for src in cfg.sources:
        for raw in read_source(src):
            rows_in += 1
            try:
                if isinstance(raw, BadRow):
                    raise raw
                messages = to_messages(raw, src.format)
                validate_conversation(messages)
            except BadRow as bad:
                dropped[bad.reason] += 1
                rejects.append(reject(src.name, bad.reason, bad.detail, raw if isinstance(raw, dict) else ""))
                continue
            key = prompt_key(messages)
            if key in seen:
                dropped["duplicate"] += 1
                continue
            seen.add(key)
            kept.append({"sample_id": sample_id(src.name, messages), "source": src.name, "messages": messages})
    return kept, rejects, dropped, rows_in


def shuffle_and_split(rows: list[dict], cfg: CurateConfig) -> tuple[list[dict], list[dict]]:
    """Deterministic shuffle by (seed, sample_id); the first eval_fraction goes to eval."""
    order = sorted(rows, key=lambda r: hashlib.sha256(f"{cfg.seed}:{r['sample_id']}".encode()).digest())
    n_eval = round(len(order) * cfg.eval_fraction)
    if cfg.eval_fraction > 0 and len(order) > 1:
        n_eval = max(1, n_eval)
    evals, trains = order[:n_eval], order[n_eval:]
    for r in evals:
        r["split"] = "eval"
    for r in trains:
        r["split"] = "train"
    return trains, evals


def run(store: Store, fp: str, cfg: RunConfig, inputs: dict[str, str]) -> dict[str, Any]:
    """Run curation and write shards, rejects and the manifest."""
    check_sources(cfg.curate)
    kept, rejects, dropped, rows_in = collect(cfg.curate)
    trains, evals = shuffle_and_split(kept, cfg.curate)
    if not trains:
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(dropped.items())) or "none"
        raise DraftflowError(f"curate kept no training conversations from {rows_in} rows "
                             f"(dropped: {reasons}); check curate.sources and their format")
    entries = []
    for split, rows in (("train", trains), ("eval", evals)):
        size = cfg.curate.shard_rows
        for i in range(0, len(rows), size):
            name = f"{split}-{i // size:05d}.parquet"
            entries.append(write_parquet(store, STAGE, fp, name, rows[i:i + size], CONVERSATION, split=split))
    result = {
        "shard": None, "rejected": write_rejects(store, STAGE, fp, "curate.parquet", rejects),
        "rows_in": rows_in, "rows_out": len(kept), "dropped": dict(dropped),
    }
    per_source = Counter(r["source"] for r in kept)
    manifest_results = [result] + [{"shard": e, "rejected": None, "rows_in": 0, "rows_out": 0, "dropped": {}}
                                   for e in entries]
    return finalize(store, STAGE, fp, cfg, inputs, manifest_results, extra={"kept_per_source": dict(per_source)})
