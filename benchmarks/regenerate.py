"""Regeneration throughput: completion tokens/s of a draftflow engine, next to its raw backend in the same run.

The prompt set is fixed: N synthetic single-turn chats rendered with the target's own chat template
(`ChatFormat.prompt_ids`), so every engine and its baseline see the same token prompts and sampling.

- `--engine vllm` (GPU, or vLLM's CPU build): draftflow's `VLLMEngine.generate` against raw
  `LLM.generate` on the same `LLM` instance, with the very same `vllm.SamplingParams` the engine
  builds; the ratio is the share of vLLM's offline throughput draftflow keeps (target >= 0.9).
  Then draftflow's transformers engine on the same prompts, and the vLLM/transformers ratio.
- `--engine hf` (CPU or GPU): `HFEngine.generate` against a plain left-padded `model.generate`
  loop over the same batches.
- `--engine openai`: draftflow's HTTP client against `--endpoint` (no baseline; compare with the
  server's own metrics).

Both sides are warmed up once, then run alternately `--repeats` times; the best time of each counts.
Run it as a module: benchmarks/tokenize.py shadows the stdlib `tokenize` when a file in this
folder runs as a script.

    python -m benchmarks.regenerate --engine hf --prompts 16
    python -m benchmarks.regenerate --engine vllm --model Qwen/Qwen3-8B --prompts 2000 --max-new-tokens 512
    python -m benchmarks.regenerate --engine vllm --model /models/Qwen3-32B --vllm tensor_parallel_size=2
"""

from __future__ import annotations

import argparse
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import torch
from pydantic import ValidationError

from draftflow.chat.format import ChatFormat
from draftflow.config import OpenAIEngineConfig, RegenerateConfig, TargetConfig, VLLMEngineConfig
from draftflow.engines import GenRequest, SamplingParams, make_engine
from draftflow.errors import DraftflowError
from draftflow.target import resolve_target

log = logging.getLogger("benchmarks.regenerate")

TOPICS = ["binary search", "photosynthesis", "the French revolution", "TCP congestion control", "sourdough bread",
          "black holes", "Rust lifetimes", "compound interest", "the immune system", "sorting networks"]
ASKS = ["Explain {t} to a beginner.", "Write a short essay about {t}.", "List five facts about {t}, with reasons.",
        "What are common misconceptions about {t}? Answer in detail.", "Compare {t} with a related idea."]


def synthetic_requests(model: str, n: int) -> list[GenRequest]:
    """N fixed chats (seeded), rendered with the target's template into serving prompt ids."""
    rng = random.Random(0)
    chat = ChatFormat.from_pretrained(model)
    requests = []
    for i in range(n):
        messages = [{"role": "user", "content": f"({i}) " + rng.choice(ASKS).format(t=rng.choice(TOPICS))}]
        requests.append(GenRequest(messages, {}, chat.prompt_ids(messages)))
    return requests


def timed(fn: Callable[[], int]) -> tuple[int, float]:
    """(completion tokens, seconds) of one run of `fn` (which returns its token count)."""
    t0 = time.perf_counter()
    tokens = fn()
    return tokens, time.perf_counter() - t0


def draftflow_run(engine, requests: list[GenRequest], params: SamplingParams, batch_size: int) -> Callable[[], int]:
    """The stage's way: `engine.generate` per batch of requests."""
    def run() -> int:
        done = [engine.generate(requests[i:i + batch_size], params) for i in range(0, len(requests), batch_size)]
        return sum(c.completion_tokens for batch in done for c in batch)
    return run


def raw_vllm_run(engine, requests: list[GenRequest], params: SamplingParams) -> Callable[[], int]:
    """vLLM's own offline path: one `LLM.generate` over the same token prompts and SamplingParams."""
    prompts = [{"prompt_token_ids": r.prompt_ids} for r in requests]
    sampling = engine.vllm_sampling(params)

    def run() -> int:
        outputs = engine.llm.generate(prompts, sampling, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)
    return run


def raw_hf_run(engine, requests: list[GenRequest], params: SamplingParams, batch_size: int) -> Callable[[], int]:
    """A plain transformers loop: left-pad each batch, `model.generate`, count tokens up to the first eos."""
    model, eos, pad = engine.model, sorted(engine.eos_ids), engine.pad_id

    @torch.no_grad()
    def batch(prompts: list[list[int]]) -> int:
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=params.max_new_tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=pad)[:, width:].tolist()
        return sum(next((j + 1 for j, t in enumerate(row) if t in eos), len(row)) for row in out)

    def run() -> int:
        return sum(batch([r.prompt_ids for r in requests[i:i + batch_size]])
                   for i in range(0, len(requests), batch_size))
    return run


def report(name: str, tokens: int, seconds: float) -> float:
    rate = tokens / seconds
    log.info("%-28s %10.1f tok/s  (%d completion tokens in %.2f s)", name, rate, tokens, seconds)
    return rate


def compare(label: str, ours: Callable[[], int], raw: Callable[[], int], repeats: int) -> None:
    """Warm both up, then alternate raw and draftflow runs; report the best tokens/s of each and their ratio.

    Alternating keeps a drift in machine load (other processes, clocks) from favouring either side.
    """
    ours(), raw()
    runs = [(timed(raw), timed(ours)) for _ in range(repeats)]
    raw_tokens, raw_s = min((r for r, _ in runs), key=lambda r: r[1])
    our_tokens, our_s = min((o for _, o in runs), key=lambda o: o[1])
    raw_rate = report(f"raw {label}", raw_tokens, raw_s)
    our_rate = report("draftflow engine", our_tokens, our_s)
    if raw_tokens != our_tokens:
        log.warning("token counts differ (%d vs %d): the outputs are not the same", our_tokens, raw_tokens)
    log.info("%-28s %10.3f", "ratio draftflow/raw", our_rate / raw_rate)


def next_to_transformers(vllm_run: Callable[[], int], model: str, args: argparse.Namespace,
                         requests: list[GenRequest], params: SamplingParams) -> None:
    """draftflow's transformers engine on the same prompts, and the vLLM / transformers throughput ratio."""
    hf = make_engine(RegenerateConfig(engine="hf"), model, args.dtype, "auto")
    try:
        hf_run = draftflow_run(hf, requests, params, args.batch_size)
        hf_run()  # warm-up
        hf_tokens, hf_s = min((timed(hf_run) for _ in range(args.repeats)), key=lambda r: r[1])
    finally:
        hf.close()
    v_tokens, v_s = min((timed(vllm_run) for _ in range(args.repeats)), key=lambda r: r[1])
    ratio = report("draftflow vLLM engine", v_tokens, v_s) / report("draftflow transformers engine", hf_tokens, hf_s)
    log.info("%-28s %10.3f", "ratio vLLM/transformers", ratio)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["hf", "vllm", "openai"], default="hf")
    ap.add_argument("--model", help="HF model folder or hub id; default: the tiny target")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16, help="requests per engine call (hf, openai)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each; the best counts")
    ap.add_argument("--vllm", action="append", default=[], metavar="KEY=VALUE", help="VLLMEngineConfig field")
    ap.add_argument("--endpoint", action="append", default=[], help="OpenAI-compatible base URL (openai)")
    return ap.parse_args(argv)


def bench(args: argparse.Namespace) -> None:
    model = args.model or resolve_target(TargetConfig()).path
    vcfg = VLLMEngineConfig(**dict(kv.split("=", 1) for kv in args.vllm))
    rcfg = RegenerateConfig(engine=args.engine, vllm=vcfg, openai=OpenAIEngineConfig(endpoints=args.endpoint))
    requests = synthetic_requests(model, args.prompts)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)  # greedy: every run yields the same tokens
    log.info("engine=%s model=%s prompts=%d (mean %d prompt tokens) max_new_tokens=%d", args.engine, model,
             len(requests), sum(len(r.prompt_ids) for r in requests) // max(len(requests), 1), args.max_new_tokens)
    engine = make_engine(rcfg, model, args.dtype, "auto")
    try:
        if args.engine == "vllm":  # one call with every request: how the stage submits a checkpoint interval
            ours = draftflow_run(engine, requests, params, len(requests))
            compare("vLLM LLM.generate", ours, raw_vllm_run(engine, requests, params), args.repeats)
            next_to_transformers(ours, model, args, requests, params)
        elif args.engine == "hf":
            compare("transformers generate", draftflow_run(engine, requests, params, args.batch_size),
                    raw_hf_run(engine, requests, params, args.batch_size), args.repeats)
        else:
            run = draftflow_run(engine, requests, params, args.batch_size)
            run()  # warm-up
            report("draftflow engine", *min((timed(run) for _ in range(args.repeats)), key=lambda r: r[1]))
    finally:
        engine.close()


def run_cli(bench_fn: Callable[[argparse.Namespace], Any], args: argparse.Namespace) -> None:
    """Run a benchmark; a setting to fix ends it with one line, no traceback."""
    try:
        bench_fn(args)
    except (DraftflowError, ValidationError) as exc:
        raise SystemExit(f"error: {' '.join(str(exc).split())}") from None


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    run_cli(bench, parse_args(argv))


if __name__ == "__main__":
    main()
