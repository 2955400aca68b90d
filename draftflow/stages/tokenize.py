"""Tokenize: conversations -> input ids + assistant-only loss mask, and token counts.

Rendering and masks come from `ChatFormat` (derived from the target's chat
template alone, no `{% generation %}` tags needed). When the regenerate stage
kept the target's generated ids, those exact ids are supervised; every
supervised span is preceded by the ids a server computes for that history.
Supervised-token frequencies are counted per shard and merged per stage
(EAGLE-3's draft vocabulary is built from them).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import pyarrow as pa

from draftflow.config import RunConfig
from draftflow.data.schema import TOKENIZED, read_rows
from draftflow.errors import ConversationError
from draftflow.stages.common import reject, shard_result, write_parquet, write_rejects
from draftflow.store import Store
from draftflow.target import TargetRef

log = logging.getLogger(__name__)
STAGE = "tokenize"
FREQ = pa.schema([("token_id", pa.int32()), ("count", pa.int64())])


def encode_rows(rows: list[dict], chat, max_length: int) -> tuple[list[dict], list[dict], Counter, Counter]:
    """Encode conversations; return (rows out, rejects, dropped by reason, token counts)."""
    out, rejects, dropped, freq = [], [], Counter(), Counter()
    for row in rows:
        completions = {g["turn"]: g["ids"] for g in row.get("generated") or []} or None
        try:
            encoded = chat.encode(row["messages"], completions, max_length,
                                  enable_thinking=bool(row.get("enable_thinking")))
        except ConversationError as exc:
            dropped["conversation_error"] += 1
            rejects.append(reject(row["source"], "conversation_error", str(exc), row["sample_id"]))
            continue
        if not encoded:
            dropped["no_supervised_tokens"] += 1
            rejects.append(reject(row["source"], "no_supervised_tokens",
                                  f"nothing supervised within max_length={max_length}", row["sample_id"]))
            continue
        for j, enc in enumerate(encoded):
            out.append({"sample_id": row["sample_id"], "row": j, "turns": enc.turns,
                        "input_ids": enc.input_ids, "loss_mask": enc.loss_mask})
            freq.update(t for t, m in zip(enc.input_ids, enc.loss_mask) if m)
    return out, rejects, dropped, freq


def run_shard(store: Store, fp: str, cfg: RunConfig, target: TargetRef, regen_fp: str,
              shard: dict[str, Any]) -> dict[str, Any]:
    """Tokenize one regenerate shard; also write its token-frequency shard."""
    from draftflow.chat import ChatFormat

    rows = read_rows(store.verify_sha("regenerate", regen_fp, shard))
    out, rejects, dropped, freq = encode_rows(rows, ChatFormat.from_pretrained(target.path), cfg.tokenize.max_length)
    tokens = sum(len(r["input_ids"]) for r in out)
    supervised = sum(freq.values())
    entry = write_parquet(store, STAGE, fp, shard["name"], out, TOKENIZED, tokens=tokens,
                          split=shard["split"], sequences=len(out), supervised_tokens=supervised)
    freq_rows = [{"token_id": t, "count": c} for t, c in sorted(freq.items())]
    freq_entry = write_parquet(store, STAGE, fp, f"freq-{shard['name']}", freq_rows, FREQ)
    rejected = write_rejects(store, STAGE, fp, shard["name"], rejects)
    conversations_out = len({r["sample_id"] for r in out})
    log.info("tokenized %s: %d sequences, %d tokens (%d supervised)", shard["name"], len(out), tokens, supervised)
    return shard_result(entry, rejected, len(rows), conversations_out, dropped, freq=freq_entry)


def merge_freq(store: Store, fp: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Sum the per-shard counts into `token_freq.parquet`; return its entry."""
    from draftflow.data.schema import write_rows
    from draftflow.store import shard_entry

    total: Counter = Counter()
    for r in results:
        for row in read_rows(store.verify_sha(STAGE, fp, r["freq"])):
            total[row["token_id"]] += row["count"]
    rows = [{"token_id": t, "count": c} for t, c in sorted(total.items())]
    with store.writing(store.stage_path(STAGE, fp, "token_freq.parquet")) as tmp:
        write_rows(tmp, rows, FREQ)
        return shard_entry("token_freq.parquet", tmp, rows=len(rows), kind="freq")
