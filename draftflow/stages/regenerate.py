"""Regenerate: the target answers every prompt itself.

The source's assistant turns are dropped and each one is generated again, in
order, conditioned on the regenerated history (`draftflow.engines.dialogs`): the
drafter must learn the target's distribution, not the dataset's. Generation is
batched across conversations turn by turn. Engines that return token ids (hf,
vllm) have them kept per turn, so tokenize supervises exactly what the target
produced. Every row records its provenance (engine, model, revision or target
fingerprint, sampling, `enable_thinking`, finish reason, token counts).

Fixed data (`regenerate.answers: source`, how EAGLE-1 trained): the sources' own answers are kept and
nothing is generated; extract's one forward pass is then the only cost of the target.

Earlier answers: a conversation this root's earlier regenerate stages already answered with the same target and
settings (`answers_key`: a refresh's curate adds new rows and reshuffles, so every shard is new) is copied from
there, not generated again; only new conversations reach the engine.

Resume: a shard is worked in chunks of `checkpoint_every` conversations; after
each chunk the finished rows and rejects are committed to `partial/<shard>`,
so a crash redoes at most one chunk. Output rows are keyed by sample id and
written in input order, whatever order they finished in.
"""

from __future__ import annotations

import functools
import json
import logging
from collections import Counter
from typing import Any

import pyarrow.parquet as pq

from draftflow import interrupt, progress
from draftflow.compat import importing_transformers
from draftflow.config import RegenerateConfig, RunConfig
from draftflow.contracts import ShardEntry, ShardResult
from draftflow.data.schema import REGENERATED, REJECTED, read_rows, rows_from_table, template_kwargs, write_rows
from draftflow.engines import GenRequest, SamplingParams, make_engine
from draftflow.engines.dialogs import Dialog, apply_completion, next_group, plan_dialog, thinking_for
from draftflow.errors import ConversationError
from draftflow.gguf_target import target_label
from draftflow.stages.common import Source, reject, shard_result, write_parquet, write_rejects
from draftflow.store import Store
from draftflow.target import TargetRef

log = logging.getLogger(__name__)
STAGE = "regenerate"
# A stop waits this long for the generate call in flight (then its chunk, unsaved, is redone by the re-run): a batch
# of long answers on a real target takes minutes, and schedulers SIGKILL 30 s after their SIGTERM.
STOP_GRACE_S = 8.0


def sampling_params(rcfg: RegenerateConfig, target_path: str) -> SamplingParams:
    """Sampling from the config, defaults from the target's `generation_config.json`."""
    with importing_transformers():
        from transformers import GenerationConfig

    try:
        gen = GenerationConfig.from_pretrained(target_path)
    except OSError:
        gen = GenerationConfig()
    sampled = bool(gen.do_sample)
    # transformers 5 leaves unset fields None (4.x filled in 1.0): sampling without a temperature is 1.0.
    gen_temperature = gen.temperature if gen.temperature is not None else 1.0
    temperature = rcfg.temperature if rcfg.temperature is not None else (gen_temperature if sampled else 0.0)
    top_p = rcfg.top_p if rcfg.top_p is not None else (gen.top_p if sampled and gen.top_p else 1.0)
    top_k = rcfg.top_k if rcfg.top_k is not None else (gen.top_k if sampled and gen.top_k else 0)
    return SamplingParams(rcfg.max_new_tokens, float(temperature or 0.0), float(top_p), int(top_k), rcfg.seed)


def context_limit(cfg: RunConfig, target_path: str) -> int | None:
    """Longest prompt + completion the target accepts (None when unknown)."""
    with importing_transformers():
        from transformers import AutoConfig

    if cfg.regenerate.engine == "vllm" and cfg.regenerate.vllm.max_model_len:
        return cfg.regenerate.vllm.max_model_len
    try:
        return getattr(AutoConfig.from_pretrained(target_path), "max_position_embeddings", None)
    except (OSError, ValueError):
        return None


def _requests(active: list[Dialog], chat, limit: int | None) -> list[tuple[Dialog, GenRequest]]:
    """Feed each dialog its next messages and render the serving prompt; mark failures."""
    out = []
    for d in active:
        group = next_group(d)
        if group is None:
            continue
        d.history.extend(group)
        kw = template_kwargs(d.row, d.thinking)
        try:
            ids = chat.prompt_ids(d.history, **kw)
        except ConversationError as exc:
            d.failed = (exc.reason, str(exc))
            continue
        if limit is not None and len(ids) >= limit:
            d.failed = ("prompt_too_long", f"prompt of {len(ids)} tokens, the target's context is {limit}")
            continue
        out.append((d, GenRequest([dict(m) for m in d.history], kw, ids)))
    return out


def regenerate_dialogs(dialogs: list[Dialog], engine, chat, params: SamplingParams, batch_size: int,
                       limit: int | None) -> None:
    """Generate every reply of every dialog, round by round (turn k of all dialogs together).

    Raises:
        interrupt.Interrupted: a stop was requested (SIGTERM, SIGINT): between two batches, so a run stops within one
            batch's time; the chunk under way is regenerated by the re-run.
    """
    while active := [d for d in dialogs if d.has_next()]:
        ready = sorted(_requests(active, chat, limit), key=lambda dr: len(dr[1].prompt_ids))
        for i in range(0, len(ready), batch_size):
            if interrupt.requested():
                raise interrupt.Interrupted("interrupted between two regenerate batches")
            _generate_batch(engine, ready[i:i + batch_size], params)


def _generate_batch(engine, batch: list[tuple[Dialog, GenRequest]], params: SamplingParams) -> None:
    """Generate one batch; a request the server refuses (a 4xx naming its index) fails only its
    own dialog, with a counted reason, and the rest of the batch is sent again."""
    from draftflow.errors import DraftflowError

    while batch:
        try:
            completions = engine.generate([r for _, r in batch], params)
        except DraftflowError as exc:
            index = getattr(exc, "index", None)
            if index is None or not 400 <= (getattr(exc, "status", None) or 0) < 500:
                raise
            batch[index][0].failed = ("request_rejected", str(exc))
            batch = batch[:index] + batch[index + 1:]
            continue
        for (d, _), c in zip(batch, completions):
            apply_completion(d, c)
        return


def output_row(d: Dialog, provenance: str) -> dict[str, Any]:
    cut = any(g["finish_reason"] == "length" for g in d.generated)
    return {
        "sample_id": d.row["sample_id"], "source": d.row["source"], "split": d.row["split"],
        "messages": d.history, "tools": d.row.get("tools"), "generated": d.generated, "provenance": provenance,
        "enable_thinking": d.thinking, "finish_reason": "length" if cut else "stop",
    }


def settle(d: Dialog, provenance: str, rcfg: RegenerateConfig) -> tuple[dict | None, dict | None]:
    """(output row, reject) for a finished dialog, by the length and tool-mismatch policies."""
    if d.cut == "cut_before_tool_result" and rcfg.tool_mismatch == "drop":
        d.failed = ("tool_call_mismatch", "the regenerated tool call differs from the source's")
    if d.failed is None and not d.generated:
        d.failed = ("nothing_generated", d.cut or "no reply was generated")
    if d.failed is not None:
        return None, reject(d.row["source"], d.failed[0], d.failed[1], d.row["sample_id"])
    row = output_row(d, provenance)
    if row["finish_reason"] == "length" and rcfg.length_policy == "drop":
        return None, reject(d.row["source"], "length", "a turn reached max_new_tokens", d.row["sample_id"])
    return row, None


def validated(rows: list[dict], chat) -> tuple[list[dict], list[dict]]:
    """(the rows the chat template accepts, a reject for each other one with its reason)."""
    valid, rejects = [], []
    for row in rows:
        try:
            chat.validate(row["messages"])
        except ConversationError as exc:
            rejects.append(reject(row["source"], exc.reason, str(exc), row["sample_id"]))
            continue
        valid.append(row)
    return valid, rejects


def regenerate_chunk(rows: list[dict], engine, chat, rcfg: RegenerateConfig, params: SamplingParams,
                     provenance: str, limit: int | None) -> tuple[list[dict], list[dict], int]:
    """Regenerate some conversations; return (rows out, rejects, conversations cut at a tool result)."""
    valid, rejects = validated(rows, chat)
    dialogs = [plan_dialog(row, thinking_for(row, rcfg.enable_thinking, rcfg.seed)) for row in valid]
    # hf batches by batch_size (memory); vllm schedules a whole round itself, and the HTTP
    # client bounds its own concurrency, so they get every request of the round at once.
    batch = rcfg.batch_size if rcfg.engine == "hf" else max(1, len(dialogs))
    regenerate_dialogs(dialogs, engine, chat, params, batch, limit)
    out = []
    for d in dialogs:
        row, rej = settle(d, provenance, rcfg)
        out += [row] if row else []
        rejects += [rej] if rej else []
    return out, rejects, sum(d.cut == "cut_before_tool_result" for d in dialogs)


def keep_source_answers(rows: list[dict], chat) -> tuple[list[dict], list[dict]]:
    """`regenerate.answers: source` (fixed data): each conversation as the source wrote it, its assistant turns
    supervised as they are (no token ids: tokenize derives them from the template). (rows out, rejects)."""
    provenance = json.dumps({"engine": "none", "answers": "source"})
    out, (valid, rejects) = [], validated(rows, chat)
    for row in valid:
        turns = [i for i, m in enumerate(row["messages"])
                 if m["role"] == "assistant" and (m.get("content") or "").strip()]
        if not turns:
            rejects.append(reject(row["source"], "no_source_answer", "regenerate.answers is source but the row has "
                                  "no assistant answer (a prompt-only row needs the target)", row["sample_id"]))
            continue
        generated = [{"turn": i, "ids": [], "finish_reason": "source", "prompt_tokens": 0, "completion_tokens": 0}
                     for i in turns]
        out.append({"sample_id": row["sample_id"], "source": row["source"], "split": row["split"],
                    "messages": row["messages"], "tools": row.get("tools"), "generated": generated,
                    "provenance": provenance, "enable_thinking": False, "finish_reason": "stop"})
    return out, rejects


def _partial_paths(store: Store, fp: str, name: str) -> tuple[str, str]:
    return store.stage_path(STAGE, fp, "partial", name), store.stage_path(STAGE, fp, "partial", f"rejected-{name}")


def load_partial(store: Store, fp: str, name: str) -> tuple[list[dict], list[dict]]:
    """Rows and rejects committed by an earlier, interrupted attempt at this shard."""
    rows_path, rej_path = _partial_paths(store, fp, name)
    out: list[list[dict]] = []
    for path in (rows_path, rej_path):
        if not store.exists(path):
            out.append([])
            continue
        with store.fs.open(path, "rb") as fh:
            out.append(rows_from_table(pq.read_table(fh)))
    return out[0], out[1]


def save_partial(store: Store, fp: str, name: str, rows: list[dict], rejects: list[dict]) -> None:
    rows_path, rej_path = _partial_paths(store, fp, name)
    for path, data, schema in ((rej_path, rejects, REJECTED), (rows_path, rows, REGENERATED)):
        with store.writing(path) as tmp:
            write_rows(tmp, data, schema)


def check_engine(cfg: RunConfig, target: TargetRef) -> None:
    """Fail before any work when the configured engine cannot serve (e.g. an unreachable URL)."""
    if cfg.regenerate.engine != "openai" or cfg.regenerate.answers == "source":
        return
    from draftflow.engines.openai import OpenAIEngine

    if not cfg.regenerate.openai.endpoints:
        from draftflow.errors import ConfigError

        raise ConfigError("regenerate.engine is openai but regenerate.openai.endpoints is empty; list the URLs")
    engine = OpenAIEngine(cfg.regenerate.openai, cfg.regenerate.openai.model or target.path)
    try:
        engine.check_reachable()
    finally:
        engine.close()


def provenance_of(engine, cfg: RunConfig, target: TargetRef, params: SamplingParams) -> str:
    return json.dumps({"engine": engine.name, "model": target_label(cfg.target), "revision": cfg.target.revision,
                       "target_fingerprint": target.fingerprint, "sampling": params.to_dict()}, sort_keys=True)


def run_shard(store: Store, fp: str, cfg: RunConfig, target: TargetRef, source: Source,
              shard: ShardEntry) -> ShardResult:
    """Regenerate one curate shard into a regenerate shard of the same name (resumable)."""
    from draftflow.chat import ChatFormat

    rcfg, name = cfg.regenerate, shard.name
    rows = read_rows(store.verify_sha(*source, shard))
    done, rejects = load_partial(store, fp, name)
    seen = {r["sample_id"] for r in done} | {r["row"] for r in rejects}
    todo = [r for r in rows if r["sample_id"] not in seen]
    if seen:
        log.info("%s: resuming, %d of %d conversations already done", name, len(rows) - len(todo), len(rows))
    if rcfg.answers != "source" and todo:
        reused, todo = answered_before(store, fp, cfg, target, todo)
        done = done + reused
    if rcfg.answers == "source":  # fixed data: nothing to generate, so no engine
        out, rej = keep_source_answers(todo, ChatFormat.from_pretrained(target.path))
        progress.report(STAGE, len(rows), len(rows), part=name)
        return _finish_shard(store, fp, shard, rows, done + out, rejects + rej, 0)
    if interrupt.requested():  # a shard that starts after the stop request: not even its engine
        raise interrupt.Interrupted(f"interrupted before regenerate {name}")
    engine = make_engine(rcfg, target.path, cfg.target.dtype, cfg.target.device, cfg.target.revision)
    chat, params = ChatFormat.from_pretrained(target.path), sampling_params(rcfg, target.path)
    provenance, limit, cut = provenance_of(engine, cfg, target, params), context_limit(cfg, target.path), 0
    with interrupt.stoppable(grace_s=STOP_GRACE_S):
        try:
            for i in range(0, len(todo), rcfg.checkpoint_every):
                out, rej, n_cut = regenerate_chunk(todo[i:i + rcfg.checkpoint_every], engine, chat, rcfg, params,
                                                   provenance, limit)
                done, rejects, cut = done + out, rejects + rej, cut + n_cut
                save_partial(store, fp, name, done, rejects)
                progress.report(STAGE, len(done) + len(rejects), len(rows), part=name)
        except interrupt.Interrupted:
            interrupt.stopped(f"regenerate {name}, {len(done) + len(rejects)} of {len(rows)} conversations saved")
            raise
    return _finish_shard(store, fp, shard, rows, done, rejects, cut)


def answers_key(cfg: RunConfig, target: TargetRef) -> str:
    """What decides a regenerated answer, less the rows: the target, its settings and the regenerate section."""
    from draftflow.store import digest

    return digest({"target": cfg.section("target"), "fingerprint": target.fingerprint,
                   "regenerate": cfg.section("regenerate")})


def answered_before(store: Store, fp: str, cfg: RunConfig, target: TargetRef, todo: list[dict]
                    ) -> tuple[list[dict], list[dict]]:
    """(rows of `todo` that a complete earlier regenerate stage of this root answered with the same
    `answers_key`, copied; the rest). Marks this stage's folder with its key, for later stages to find."""
    key = answers_key(cfg, target)
    mark = store.stage_path(STAGE, fp, "answers.key")
    if not store.exists(mark):
        store.write_bytes(mark, key.encode())
    wanted = {r["sample_id"] for r in todo}
    found: dict[str, dict] = {}
    for other in sorted(store.fs.glob(store.stage_path(STAGE, "*", "answers.key"))):
        other_fp = other.rstrip("/").split("/")[-2]
        if other_fp == fp or store.fs.cat_file(other).decode() != key:  # the small key file first: a manifest
            continue  # read checks every shard's checksum, which stages of other settings need not pay
        manifest = store.read_manifest(STAGE, other_fp)
        if manifest is None:
            continue
        for entry in manifest.data_shards():
            path = store.local_path(store.stage_path(STAGE, other_fp, entry.name), entry.sha256)
            if wanted & _ids(path, entry.sha256):
                found |= {r["sample_id"]: r for r in read_rows(path) if r["sample_id"] in wanted}
        if len(found) == len(wanted):
            break
    if found:
        log.info("%s: %d of %d conversations answered by an earlier regenerate stage, copied", fp, len(found),
                 len(todo))
    return [found[r["sample_id"]] for r in todo if r["sample_id"] in found], \
        [r for r in todo if r["sample_id"] not in found]


@functools.lru_cache(maxsize=4096)
def _ids(path: str, sha256: str) -> frozenset[str]:
    """The sample ids of a committed regenerate shard (read once per process: every shard task asks)."""
    return frozenset(pq.read_table(path, columns=["sample_id"])["sample_id"].to_pylist())


def _finish_shard(store: Store, fp: str, shard: ShardEntry, rows: list[dict], done: list[dict], rejects: list[dict],
                  cut: int) -> ShardResult:
    order = {r["sample_id"]: i for i, r in enumerate(rows)}
    done = sorted(done, key=lambda r: order[r["sample_id"]])
    ids = [r["sample_id"] for r in done] + [r["row"] for r in rejects]
    assert len(ids) == len(set(ids)) == len(rows), "regenerate lost or duplicated a conversation"
    tokens = sum(g["completion_tokens"] for r in done for g in r["generated"])
    entry = write_parquet(store, STAGE, fp, shard.name, done, REGENERATED, tokens=tokens, split=shard.split)
    rejected = write_rejects(store, STAGE, fp, shard.name, rejects)
    for path in _partial_paths(store, fp, shard.name):
        if store.exists(path):
            store.fs.rm(path)
    dropped = Counter(r["reason"] for r in rejects)
    finish = Counter(r["finish_reason"] for r in done)
    log.info("regenerated %s: %d conversations, %d tokens, dropped %s", shard.name, len(done), tokens,
             dict(dropped) or "nothing")
    return shard_result(entry, rejected, len(rows), len(done), dropped, finish_reasons=dict(finish),
                        cut_before_tool_result=cut)
