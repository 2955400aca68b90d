"""Tokenize: conversations -> input ids + assistant-only loss mask, token counts, draft vocab.

Rendering and masks come from `ChatFormat` (derived from the target's chat
template alone, no `{% generation %}` tags needed); `tokenize.policy` picks
which assistant turns a row supervises. When the regenerate stage kept the
target's generated ids, those exact ids are supervised, and every supervised
span is preceded by the ids a server computes for that history. Rows are
right-truncated to `max_length`; rows left with fewer than
`min_supervised_tokens` supervised tokens are dropped with a counted reason.
Supervised-token frequencies give the EAGLE-3 draft vocabulary (`d2t`, `t2d`).

Accounting: rows_in/rows_out/dropped count conversations (the unit the
upstream stage hands over); the sequences a conversation yields, and the
sequences dropped by reason, are reported beside them.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from functools import lru_cache
from typing import Any

import pyarrow as pa

from draftflow.config import RunConfig, TokenizeConfig
from draftflow.contracts import CARRIED, CarriedFile, ShardEntry, ShardResult
from draftflow.data.schema import TOKENIZED, read_rows, template_kwargs, write_rows
from draftflow.drafters.taps import min_supervised_tokens
from draftflow.errors import ConversationError
from draftflow.stages.common import Source, reject, shard_result, write_parquet, write_rejects
from draftflow.store import Store, shard_entry
from draftflow.target import TargetRef

log = logging.getLogger(__name__)
STAGE = "tokenize"
FREQ = pa.schema([("token_id", pa.int32()), ("count", pa.int64())])
ROWS_PER_WORKER = 2000  # below this a worker process costs more than it saves


def min_supervised(cfg: RunConfig) -> int:
    """`tokenize.min_supervised_tokens`, else what the drafter kind needs (its `DataRule.min_supervised`:
    DFlash 2 x block_size, room for anchors and blocks; EAGLE-3 2 x (ttt_steps + 1))."""
    return min_supervised_tokens(cfg.drafter, cfg.tokenize.min_supervised_tokens)


def truncate(ids: list[int], mask: list[int], max_length: int, minimum: int) -> tuple[list, list, str | None]:
    """Right-truncate a row; return (ids, mask, drop reason or None)."""
    ids, mask = ids[:max_length], mask[:max_length]
    n = sum(mask)
    if n == 0:
        return ids, mask, "truncated_away"
    if n < minimum:
        return ids, mask, "too_few_supervised_tokens"
    return ids, mask, None


def _keep_rows(row: dict, encoded: list, tcfg: TokenizeConfig, minimum: int) -> tuple[list[dict], Counter]:
    """Truncate a conversation's rows; return those kept and the drops by reason."""
    out, drops = [], Counter()
    for enc in encoded:
        ids, mask, why = truncate(enc.input_ids, enc.loss_mask, tcfg.max_length, minimum)
        if why:
            drops[why] += 1
            continue
        out.append({"sample_id": row["sample_id"], "row": len(out), "turns": enc.turns,
                    "input_ids": ids, "loss_mask": mask})
    return out, drops


def count_supervised(freq: Counter, ids: list[int], mask: list[int]) -> None:
    """Add the ids under mask 1 to `freq`, a run of supervised ids at a time (a 0/1 mask)."""
    flags = bytes(mask)
    start = flags.find(1)
    while start != -1:
        end = flags.find(0, start)
        end = len(flags) if end == -1 else end
        freq.update(ids[start:end])
        start = flags.find(1, end)


def _request(row: dict):
    from draftflow.chat import EncodeRequest

    generated = row.get("generated") or []
    # Text-only engines (HTTP chat) leave ids empty: then every turn's ids come from the template.
    completions = {g["turn"]: g["ids"] for g in generated} if generated and all(g["ids"] for g in generated) else None
    return EncodeRequest(row["messages"], completions, template_kwargs(row, bool(row.get("enable_thinking"))))


@lru_cache(maxsize=2)
def _chat(target_path: str):
    from draftflow.chat import ChatFormat

    return ChatFormat.from_pretrained(target_path)


def encode_rows(rows: list[dict], target_path: str, tcfg: TokenizeConfig, minimum: int) -> dict[str, Any]:
    """Encode conversations in this process (all texts of the batch tokenized in one call).

    Returns:
        rows, rejects, dropped (conversations by reason), seq_drops (sequences by reason), freq.
    """
    from draftflow.chat.encode import gc_paused

    chat = _chat(target_path)
    with gc_paused():  # the rows are many lists and no cycles: see gc_paused
        return _encode_rows(rows, chat, tcfg, minimum)


def _encode_rows(rows: list[dict], chat: Any, tcfg: TokenizeConfig, minimum: int) -> dict[str, Any]:
    out, rejects, dropped, seq_drops, freq = [], [], Counter(), Counter(), Counter()
    results = chat.encode_many([_request(r) for r in rows], None, tcfg.policy)
    for row, result in zip(rows, results):
        if isinstance(result, ConversationError):
            reason, detail, kept = getattr(result, "reason", "conversation_error"), str(result), []
        else:
            kept, drops = _keep_rows(row, result, tcfg, minimum)
            seq_drops.update(drops)
            reason = "" if kept else (drops.most_common(1)[0][0] if drops else "no_supervised_tokens")
            detail = f"no row kept ({dict(drops) or 'nothing supervised'})"
        if reason:
            dropped[reason] += 1
            rejects.append(reject(row["source"], reason, detail, row["sample_id"]))
        for r in kept:
            count_supervised(freq, r["input_ids"], r["loss_mask"])
        out += kept
    return {"rows": out, "rejects": rejects, "dropped": dropped, "seq_drops": seq_drops, "freq": freq}


def encode_parallel(rows: list[dict], target_path: str, tcfg: TokenizeConfig, minimum: int) -> dict[str, Any]:
    """`encode_rows` over worker processes for big shards (Jinja rendering holds the GIL)."""
    workers = tcfg.num_workers or min(os.cpu_count() or 1, max(1, len(rows) // ROWS_PER_WORKER))
    if workers <= 1:
        return encode_rows(rows, target_path, tcfg, minimum)
    size = -(-len(rows) // workers)
    chunks = [rows[i:i + size] for i in range(0, len(rows), size)]
    import multiprocessing

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        parts = list(pool.map(encode_rows, chunks, [target_path] * len(chunks), [tcfg] * len(chunks),
                              [minimum] * len(chunks)))
    merged: dict[str, Any] = {"rows": [], "rejects": [], "dropped": Counter(), "seq_drops": Counter(),
                              "freq": Counter()}
    for part in parts:
        for key, value in part.items():
            merged[key] += value
    return merged


def run_shard(store: Store, fp: str, cfg: RunConfig, target: TargetRef, source: Source,
              shard: ShardEntry) -> ShardResult:
    """Tokenize one regenerate shard; also write its token-frequency shard."""
    rows = read_rows(store.verify_sha(*source, shard))
    res = encode_parallel(rows, target.path, cfg.tokenize, min_supervised(cfg))
    out, freq = res["rows"], res["freq"]
    tokens, supervised = sum(len(r["input_ids"]) for r in out), sum(freq.values())
    entry = write_parquet(store, STAGE, fp, shard.name, out, TOKENIZED, tokens=tokens,
                          split=shard.split, sequences=len(out), supervised_tokens=supervised)
    freq_rows = [{"token_id": t, "count": c} for t, c in sorted(freq.items())]
    freq_entry = write_parquet(store, STAGE, fp, f"freq-{shard.name}", freq_rows, FREQ)
    rejected = write_rejects(store, STAGE, fp, shard.name, res["rejects"])
    conversations_out = len({r["sample_id"] for r in out})
    log.info("tokenized %s: %d sequences, %d tokens (%d supervised), dropped %s", shard.name, len(out),
             tokens, supervised, dict(res["dropped"]) or "nothing")
    return shard_result(entry, rejected, len(rows), conversations_out, res["dropped"], freq=freq_entry,
                        sequence_drops=dict(res["seq_drops"]))


def merge_freq(store: Store, fp: str, results: list[ShardResult]) -> Counter:
    total: Counter = Counter()
    for r in results:
        for row in read_rows(store.verify_sha(STAGE, fp, r.info["freq"])):
            total[row["token_id"]] += row["count"]
    return total


def write_vocab_files(store: Store, fp: str, cfg: RunConfig, target: TargetRef,
                      results: list[ShardResult]) -> list[ShardEntry]:
    """Write `token_freq.parquet` (supervised token counts); return its manifest entry in a list.

    The EAGLE-3 draft vocabulary is chosen from these counts by the train stage (`draft_vocab`),
    so changing `drafter.draft_vocab_size` never changes this stage's digest, which would
    recompute every feature shard downstream.
    """
    total = merge_freq(store, fp, results)
    entries = []
    with store.writing(store.stage_path(STAGE, fp, "token_freq.parquet")) as tmp:
        write_rows(tmp, [{"token_id": t, "count": c} for t, c in sorted(total.items())], FREQ)
        entries.append(shard_entry("token_freq.parquet", tmp, rows=len(total), kind="freq"))
    return entries


def finish_stage(store: Store, fp: str, cfg: RunConfig, target: TargetRef,
                 results: list[ShardResult]) -> tuple[list[ShardResult], dict[str, Any]]:
    """After every shard: the vocabulary file joins the results; the manifest's extra counts sequences
    (rows a conversation became) and the sequences dropped, by reason."""
    vocab = write_vocab_files(store, fp, cfg, target, results)
    drops: Counter = sum((Counter(r.info["sequence_drops"]) for r in results), Counter())
    results = results + [ShardResult(shard=e, rows_in=0, rows_out=0) for e in vocab]
    extra = {"sequences": sum(r.shard.sequences or 0 for r in results if r.shard),
             "sequences_dropped": dict(sorted(drops.items())), "policy": cfg.tokenize.policy}
    freq = next((e for e in vocab if e.kind == "freq"), None)
    if freq is not None:  # handed on to train (draft vocabularies) by every stage in between: `contracts.carry`
        extra[CARRIED] = {"token_counts": CarriedFile(stage=STAGE, fingerprint=fp, entry=freq).model_dump(mode="json")}
    return results, extra
