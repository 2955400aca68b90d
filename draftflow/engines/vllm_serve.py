"""Serve the target in vLLM, with or without a speculative method, and measure what a server would see.

`serve_with_vllm` starts a `vllm.LLM` on the target with an export as its `speculative_config`
(or another method, e.g. vLLM's n-gram prompt lookup, or none at all), decodes the prompts
greedily, and reads vLLM's own speculative-decoding counters: mean acceptance length =
1 + accepted / drafts (vLLM's definition; the same quantity as draftflow's τ, tokens per target
step), and P(at least k drafts accepted) from the per-position counts. With `batches` it also
times the decoding: output tokens per second at each batch size (batch 1: one request at a time;
batch 8: eight in flight), after an untimed warm-up request. Batch 1 is decoded one request per
call, so the counters are also known per prompt (vLLM's τ per category).

The evaluate stage compares the tokens with the target's greedy output (lossless) and vLLM's τ with
draftflow's own on the same prompts: a gap means training and serving disagree (taps, mask token,
layer ids, attention rules), the quiet failure this check exists for; the tokens/s with and
without the drafter are the served speedup (measured, not predicted).

Does not know: stores, stages or how the export was made; it needs vLLM (imported lazily through
`draftflow.engines.vllm`). Trade-off: one engine start per method (tens of seconds on CPU), and
timings are measurements of this machine under its current load, never fingerprinted content.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftflow.config import VLLMEngineConfig
from draftflow.errors import ConfigError

log = logging.getLogger(__name__)

WARMUP_TOKENS = 8


@dataclass(frozen=True)
class ServedResult:
    """What vLLM did with one method: its tokens per prompt, its acceptance counters and its speed.

    Attributes:
        tokens: per prompt, the generated ids at the first measured batch size.
        per_prompt: per prompt (batch 1 only), (drafts, accepted) counted by vLLM while decoding it.
        tok_s: batch size -> output tokens per second (empty without `batches`).
        tokens_by_batch: batch size -> per prompt ids at that batch size (lossless across batches).
    """

    export: str
    tokens: list[list[int]]
    tau: float | None
    acceptance_rate: list[float]
    drafts: int
    accepted: int
    per_prompt: list[tuple[int, int]] = field(default_factory=list)
    tok_s: dict[int, float] = field(default_factory=dict)
    tokens_by_batch: dict[int, list[list[int]]] = field(default_factory=dict)
    probe: dict[int, dict[int, float]] = field(default_factory=dict)  # batch -> new positions -> s (`probe_verify`)


def speculative_config(export_dir: str | Path) -> dict[str, Any]:
    """vLLM's `speculative_config` for an export folder: method and draft count as its config.json says
    (DFlash: block_size - 1; EAGLE-3: its chain depth), the same as the folder's README serve line.

    Raises:
        ConfigError: the folder has no config.json; StoreError: it is no draftflow export.
    """
    from draftflow.export_readme import speculative_settings

    path = Path(export_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"no drafter export at {export_dir} (config.json missing); run the train stage first")
    method, tokens = speculative_settings(json.loads(path.read_text()))
    return {"method": method, "model": str(export_dir), "num_speculative_tokens": tokens}


def with_drafts(spec: dict[str, Any], num_speculative_tokens: int) -> dict[str, Any]:
    """`spec` serving `num_speculative_tokens` drafts a step instead of its own number."""
    return spec | {"num_speculative_tokens": int(num_speculative_tokens)}


def prompt_lookup_config(num_speculative_tokens: int, max_ngram: int = 3) -> dict[str, Any]:
    """vLLM's n-gram prompt lookup, the served counterpart of draftflow's `prompt_lookup` baseline (the last 3, 2
    or 1 tokens). vLLM counts only the steps where it found a match, so its τ is per drafting step."""
    return {"method": "ngram", "num_speculative_tokens": int(num_speculative_tokens),
            "prompt_lookup_max": max_ngram, "prompt_lookup_min": 1}


def _counters(llm: Any) -> tuple[int, int, list[int]]:
    """(drafts, accepted draft tokens, accepted per draft position) from vLLM's metrics."""
    drafts = accepted = 0
    per_pos: list[int] = []
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            drafts += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            accepted += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = [a + int(b) for a, b in zip(per_pos or [0] * len(m.values), m.values)]
    return drafts, accepted, per_pos


def _generate(llm: Any, prompts: list[list[int]], params: Any) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _decode_batch_one(llm: Any, prompts: list[list[int]], params: Any) -> tuple[list[list[int]], list, float]:
    """One request per call: the tokens, (drafts, accepted) per prompt, and the seconds spent generating."""
    tokens, per_prompt, seconds = [], [], 0.0
    before = _counters(llm)[:2]
    for p in prompts:
        start = time.perf_counter()
        tokens += _generate(llm, [p], params)
        seconds += time.perf_counter() - start
        after = _counters(llm)[:2]
        per_prompt.append((after[0] - before[0], after[1] - before[1]))
        before = after
    return tokens, per_prompt, seconds


def _decode_batched(llm: Any, prompts: list[list[int]], params: Any, batch: int) -> tuple[list[list[int]], float]:
    tokens, seconds = [], 0.0
    for i in range(0, len(prompts), batch):
        start = time.perf_counter()
        tokens += _generate(llm, prompts[i:i + batch], params)
        seconds += time.perf_counter() - start
    return tokens, seconds


def _window(before: tuple[int, int, list[int]], after: tuple[int, int, list[int]]) -> tuple[int, int, list[int]]:
    """The counters' growth between two snapshots: (drafts, accepted, accepted per position)."""
    per_pos = [a - b for a, b in zip(after[2], before[2] or [0] * len(after[2]))]
    return after[0] - before[0], after[1] - before[1], per_pos


def decode_timed(llm: Any, vllm: Any, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int],
                 batches: tuple[int, ...], warm_up: bool = True) -> dict[str, Any]:
    """Greedy decoding of `prompts` at each batch size in order, after an untimed warm-up request.

    Returns:
        tokens_by_batch, tok_s (per batch size), per_prompt (batch 1's (drafts, accepted), else empty) and
        counters: vLLM's (drafts, accepted, per position) over the first batch size only (no warm-up, no
        repeats), so τ and P(at least k accepted) describe the same decoding.
    """
    params = vllm.SamplingParams(max_tokens=max_new_tokens, temperature=0.0, stop_token_ids=list(stop_ids),
                                 detokenize=False)
    if warm_up:  # first-call costs (allocation, kernel choice) are not serving speed
        _generate(llm, prompts[:1], vllm.SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0, detokenize=False))
    out: dict[str, Any] = {"tokens_by_batch": {}, "tok_s": {}, "per_prompt": []}
    for b in batches:
        before = _counters(llm)
        if b == 1:
            tokens, out["per_prompt"], seconds = _decode_batch_one(llm, prompts, params)
        else:
            tokens, seconds = _decode_batched(llm, prompts, params, b)
        out.setdefault("counters", _window(before, _counters(llm)))
        out["tokens_by_batch"][b] = tokens
        out["tok_s"][b] = sum(map(len, tokens)) / max(seconds, 1e-9)
    return out


PROBE_CONTEXT = 64  # tokens of cached context before the probed positions (whole KV-cache blocks of 16)
PROBE_REPEATS = 5


def probe_verify(llm: Any, vllm: Any, prompts: list[list[int]], positions: int, batches: tuple[int, ...],
                 repeats: int = PROBE_REPEATS) -> dict[int, dict[int, float]]:
    """What computing n new positions after a cached context costs the serving engine, n = 1..`positions`.

    Each request is a prompt's first `PROBE_CONTEXT` tokens (cached by a first, untimed request: vLLM keeps
    whole blocks) plus n new tokens, sampling one: the forward a speculative step runs to verify n-1 drafts,
    plus a request's fixed overhead, which `serve_choice.verify_from_probe` cancels out. The n tokens change
    at every repeat (never a cache hit). Returns batch -> n -> median seconds of one request per sequence.
    """
    import statistics

    params = vllm.SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    pool = [t for p in prompts for t in p] or [0]
    contexts = [(list(p) * PROBE_CONTEXT)[:PROBE_CONTEXT] if p else pool[:PROBE_CONTEXT] for p in prompts]
    out: dict[int, dict[int, float]] = {}
    for b in batches:
        group = (contexts * b)[:b]
        _generate(llm, group, params)  # caches the contexts
        out[b] = {}
        for n in range(1, positions + 1):
            times = []
            for r in range(repeats + 1):
                extra = [[pool[(17 * (r * positions + n) + 31 * i + j) % len(pool)] for j in range(n)]
                         for i in range(b)]
                start = time.perf_counter()
                _generate(llm, [c + e for c, e in zip(group, extra)], params)
                if r:  # the first is a warm-up of this shape
                    times.append(time.perf_counter() - start)
            out[b][n] = statistics.median(times)
    return out


@dataclass(frozen=True)
class ServeJob:
    """What every served decode of one evaluation shares: the target, how vLLM runs it, and the prompts.

    Attributes:
        batches: batch sizes to time (e.g. (1, 8)); empty: one untimed batch of every prompt.
        categories: each prompt's category (for vLLM's τ per category), or empty.
    """

    target_path: str
    prompts: list[list[int]]
    max_new_tokens: int
    stop_ids: list[int]
    vcfg: VLLMEngineConfig
    dtype: str = "auto"
    batches: tuple[int, ...] = ()
    categories: tuple[str, ...] = ()
    probe_positions: int = 0  # plain decoding: also `probe_verify` up to this many new positions (0: no probe)


def serve_with_vllm(job: ServeJob, export_dir: str | Path | None = None,
                    spec: dict[str, Any] | None = None) -> ServedResult:
    """Greedy decoding of `job.prompts` in vLLM with the drafter at `export_dir` (or `spec`, or neither: plain).

    Args:
        spec: a `speculative_config` to use instead of the export's (e.g. `prompt_lookup_config`).

    Raises:
        DraftflowError: vLLM is missing; ConfigError: no export there, or (on CPU) an unsupported head size.
    """
    from draftflow.engines.vllm import (
        check_head_size,
        engine_kwargs,
        import_vllm,
        prepare_environment,
        release_engines,
        shutdown_llm,
    )

    vllm = import_vllm()
    if spec is None and export_dir is not None:
        spec = speculative_config(export_dir)
        check_head_size(str(export_dir), what="drafter export")
    check_head_size(job.target_path)
    prepare_environment(job.vcfg)
    release_engines()  # a generation or capture engine of this process would hold the memory
    extra = {"speculative_config": spec} if spec else {}
    probing = job.probe_positions > 0 and spec is None and bool(job.batches)
    if probing:
        extra["enable_prefix_caching"] = True  # the probe's contexts are computed once
    llm = vllm.LLM(model=job.target_path, disable_log_stats=False, **extra,
                   **engine_kwargs(job.vcfg, job.target_path, job.dtype))
    try:
        run = decode_timed(llm, vllm, job.prompts, job.max_new_tokens, job.stop_ids,
                           job.batches or (len(job.prompts) or 1,), warm_up=bool(job.batches))
        if probing:
            run["probe"] = probe_verify(llm, vllm, job.prompts, job.probe_positions, job.batches)
    finally:
        shutdown_llm(llm)
    drafts, accepted, per_pos = run["counters"]
    tau = 1.0 + accepted / drafts if drafts else None
    rate = [a / drafts for a in per_pos] if drafts else []  # P(at least k drafts accepted), k = 1..
    name = str(export_dir) if export_dir is not None else (spec or {}).get("method", "plain")
    log.info("vLLM served %s: tau %s, tokens/s %s", name, f"{tau:.3f}" if tau else "n/a",
             {b: round(v, 1) for b, v in run["tok_s"].items()})
    first = next(iter(run["tokens_by_batch"]))
    return ServedResult(name, run["tokens_by_batch"][first], tau, rate, drafts, accepted, run["per_prompt"],
                        run["tok_s"] if job.batches else {}, run["tokens_by_batch"], run.get("probe", {}))
