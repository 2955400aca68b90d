"""Regenerate: the target answers every prompt itself.

The source's assistant turns are dropped and each one is generated again, in
order, conditioned on the regenerated history (the drafter must learn the
target's distribution, not the dataset's). Generation is batched across
conversations turn by turn. The generated token ids are kept per turn so the
tokenize stage supervises exactly what the target produced; provenance
(engine, model, target fingerprint, sampling) is recorded on every row.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from draftflow.config import RunConfig
from draftflow.data.schema import REGENERATED, message, read_rows, template_kwargs
from draftflow.engines import Completion, Engine, SamplingParams, make_engine
from draftflow.errors import ConversationError
from draftflow.stages.common import reject, shard_result, write_parquet, write_rejects
from draftflow.store import Store
from draftflow.target import TargetRef

log = logging.getLogger(__name__)
STAGE = "regenerate"


@dataclass
class Dialog:
    """One conversation being regenerated: source turns still to feed, history so far."""

    row: dict[str, Any]
    pending: list[list[dict]]  # groups of non-assistant messages, each followed by a reply
    history: list[dict] = field(default_factory=list)
    generated: list[dict] = field(default_factory=list)
    cut_at_tool_result: bool = False


def plan_dialog(row: dict[str, Any]) -> Dialog:
    """Split the source into groups of prompt messages, each answered by one generated turn.

    A reply goes wherever the source had an assistant turn, and after the last
    message when the source ends on a user message. The conversation is cut
    before its first tool result: the regenerated turn may call a different tool
    (or none), so the source's result would no longer answer it. Executing tools
    or matching regenerated calls to source calls is later work.
    """
    groups: list[list[dict]] = [[]]
    cut = False
    for m in row["messages"]:
        if m["role"] == "tool":
            cut = True
            break
        if m["role"] == "assistant":
            if groups[-1]:
                groups.append([])
        else:
            groups[-1].append(message(m["role"], m["content"], m.get("reasoning_content")))
    if not groups[-1]:
        groups.pop()
    return Dialog(row=row, pending=groups, cut_at_tool_result=cut)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """Separate `<think>…</think>` reasoning from the answer text."""
    if "</think>" not in text:
        return None, text
    reasoning, content = text.split("</think>", 1)
    return reasoning.replace("<think>", "").strip() or None, content.lstrip("\n")


def _next_prompts(dialogs: list[Dialog], chat, enable_thinking: bool) -> tuple[list, list[tuple]]:
    """Serving prompts for each dialog's next turn, and the dialogs whose history cannot render."""
    out, failed = [], []
    for d in dialogs:
        d.history.extend(d.pending.pop(0))
        try:
            out.append((d, chat.prompt_ids(d.history, **template_kwargs(d.row, enable_thinking))))
        except ConversationError as exc:
            d.pending.clear()
            failed.append((d, exc))
    return out, failed


def _apply(d: Dialog, c: Completion, tokenizer, eos_ids: set[int]) -> None:
    body = c.ids[:-1] if c.ids and c.ids[-1] in eos_ids else c.ids
    reasoning, content = split_reasoning(tokenizer.decode(body, skip_special_tokens=False))
    d.generated.append({
        "turn": len(d.history), "ids": c.ids, "finish_reason": c.finish_reason,
        "prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.ids),
    })
    d.history.append(message("assistant", content, reasoning))


def regenerate_rows(rows: list[dict], engine: Engine, chat, params: SamplingParams, batch_size: int,
                    enable_thinking: bool) -> tuple[list[Dialog], list[dict], Counter]:
    """Regenerate every assistant turn of `rows`; invalid conversations are rejected."""
    dialogs, rejects, dropped = [], [], Counter()
    for row in rows:
        try:
            chat.validate(row["messages"])
        except ConversationError as exc:
            dropped[exc.reason] += 1
            rejects.append(reject(row["source"], exc.reason, str(exc), row))
            continue
        dialogs.append(plan_dialog(row))
    while active := [d for d in dialogs if d.pending]:
        ready, failed = _next_prompts(active, chat, enable_thinking)
        for d, exc in failed:
            dialogs.remove(d)
            dropped[exc.reason] += 1
            rejects.append(reject(d.row["source"], exc.reason, str(exc), d.row))
        prompts = sorted(ready, key=lambda dp: len(dp[1]))
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i:i + batch_size]
            for (d, _), c in zip(batch, engine.generate([p for _, p in batch], params)):
                _apply(d, c, engine.tokenizer, engine.eos_ids)
    return dialogs, rejects, dropped


def output_row(d: Dialog, provenance: str, enable_thinking: bool) -> dict[str, Any]:
    cut = any(g["finish_reason"] == "length" for g in d.generated)
    return {
        "sample_id": d.row["sample_id"], "source": d.row["source"], "split": d.row["split"],
        "messages": d.history, "tools": d.row.get("tools"), "generated": d.generated, "provenance": provenance,
        "enable_thinking": enable_thinking, "finish_reason": "length" if cut else "stop",
    }


def run_shard(store: Store, fp: str, cfg: RunConfig, target: TargetRef, curate_fp: str,
              shard: dict[str, Any]) -> dict[str, Any]:
    """Regenerate one curate shard into a regenerate shard of the same name."""
    from draftflow.chat import ChatFormat

    rcfg = cfg.regenerate
    rows = read_rows(store.verify_sha("curate", curate_fp, shard))
    engine = make_engine(rcfg.engine, target.path, cfg.target.dtype, cfg.target.device)
    params = SamplingParams(rcfg.max_new_tokens, rcfg.temperature, rcfg.top_p, rcfg.top_k, rcfg.seed)
    dialogs, rejects, dropped = regenerate_rows(
        rows, engine, ChatFormat(engine.tokenizer), params, rcfg.batch_size, rcfg.enable_thinking)
    provenance = json.dumps({"engine": engine.name, "model": cfg.target.path or "tiny",
                             "revision": cfg.target.revision, "target_fingerprint": target.fingerprint,
                             "sampling": params.to_dict()}, sort_keys=True)
    out = [output_row(d, provenance, rcfg.enable_thinking) for d in dialogs]
    tokens = sum(g["completion_tokens"] for d in dialogs for g in d.generated)
    lengths = Counter(r["finish_reason"] for r in out)
    cut = sum(d.cut_at_tool_result for d in dialogs)
    entry = write_parquet(store, STAGE, fp, shard["name"], out, REGENERATED, tokens=tokens, split=shard["split"])
    rejected = write_rejects(store, STAGE, fp, shard["name"], rejects)
    log.info("regenerated %s: %d conversations, %d tokens, finish %s", shard["name"], len(out), tokens, dict(lengths))
    return shard_result(entry, rejected, len(rows), len(out), dropped, finish_reasons=dict(lengths),
                        cut_before_tool_result=cut)
