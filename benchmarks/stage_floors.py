"""Every stage's throughput on a run config's target against its floor, measured in one run.

One table row per stage: draftflow's way of doing the stage's work next to the plainest way of doing
the same work on the same machine, in the same process, on the same inputs:

- regenerate: `VLLMEngine.generate` vs bare `LLM.generate` with the same SamplingParams on the same
  `LLM` (`regenerate.engine: vllm`, vLLM importable); otherwise `HFEngine.generate` vs a plain
  left-padded `model.generate`. Greedy, so both sides produce the same completion tokens.
- extract: `capture_in_batches` with the configured capture engine (what the extract stage runs per
  checkpoint interval) on the regenerated rows (prompt + completion) vs a plain full `model(input_ids)`
  forward of the same length-sorted, right-padded batches. The hf capture stops after the last tap and
  skips the LM head, so this ratio can exceed 1.
- train: `_train_step` (anchors, blocks, decayed loss, clip, AdamW) of the config's drafter on the
  captured features (completion tokens supervised) vs forward + cross entropy on every slot + backward +
  AdamW of the same modules on the same blocks, built beforehand. Supervised block tokens/s.
- evaluate: KV-cached speculative decoding (`speculative_generate_cached`, features rounded like the
  stored ones) vs greedy decoding with the same cached loop (`greedy_generate_cached`). Output tokens/s.
  The drafter is a fresh, untrained one of the config's shape (or `--drafter DIR`, measured before the
  train row steps it): rarely accepted, so that ratio is a lower bound of what a trained drafter gives.

Each side is warmed up once, then both run alternately `--repeats` times; the best time of each counts.
Ratios only, no pass/fail. `DRAFTFLOW_TORCH_THREADS` sets this process's torch threads (default: torch's):
on a shared, loaded CPU machine set it to 1, since threads waiting for a busy core make timings erratic.
Run it as a module (benchmarks/tokenize.py shadows the stdlib otherwise):

    DRAFTFLOW_TORCH_THREADS=1 .venv-vllm/bin/python -m benchmarks.stage_floors --config configs/smollm2.yaml
    python -m benchmarks.stage_floors --config configs/tiny.yaml --prompts 2 --max-new-tokens 16
"""

from __future__ import annotations

import argparse
import datetime
import functools
import logging
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks.regenerate import draftflow_run, raw_hf_run, raw_vllm_run, run_cli, synthetic_requests, timed
from draftflow.config import RunConfig, load_config
from draftflow.drafters.batches import IGNORE
from draftflow.drafters.registry import DraftInputs, drafter_spec, feature_ids, spec_for_architecture
from draftflow.engines import GenRequest, SamplingParams, make_engine
from draftflow.engines.capture import capture_in_batches, make_capture_engine, right_pad
from draftflow.errors import DraftflowError
from draftflow.evaluation.cached import greedy_generate_cached, speculative_generate_cached
from draftflow.features import FeatureSample, round_trip
from draftflow.models.weights import read_weights_and_config
from draftflow.stages.extract import target_depth
from draftflow.target import eos_token_ids, load_target, resolve_target
from draftflow.training.distributed import DistEnv, adamw, prepare_model
from draftflow.training.job import as_stored, mask_token_id
from draftflow.training.loop import _Run, _train_step
from draftflow.training.schedule import warmup_cosine

Run = Callable[[], int]  # one timed pass over the stage's work; returns the tokens it processed


@dataclass
class Row:
    stage: str
    ours: float  # tokens/s
    floor: float  # tokens/s
    what: str  # what the floor is


def best_of(ours: Run, floor: Run, repeats: int) -> tuple[float, float]:
    """(ours, floor) tokens/s: one warm-up each, then `repeats` alternating runs; the best time of each counts."""
    ours(), floor()
    runs = [(timed(floor), timed(ours)) for _ in range(repeats)]
    return max(t / s for _, (t, s) in runs), max(t / s for (t, s), _ in runs)


# ----------------------------------------------------------------------------- regenerate


def vllm_usable(cfg: RunConfig) -> bool:
    if cfg.regenerate.engine != "vllm":
        return False
    from draftflow.engines.vllm import import_vllm

    try:
        import_vllm()
        return True
    except DraftflowError:
        return False


def regenerate_row(cfg: RunConfig, path: str, requests: list[GenRequest], params: SamplingParams,
                   repeats: int) -> tuple[Row, list[list[int]]]:
    """The regenerate row, and the completion ids of every request (draftflow's engine, greedy)."""
    use_vllm = vllm_usable(cfg)
    rcfg = cfg.regenerate if use_vllm else cfg.regenerate.model_copy(update={"engine": "hf"})
    engine = make_engine(rcfg, path, cfg.target.dtype, cfg.target.device, cfg.target.revision)
    try:
        if use_vllm:  # the stage submits a whole checkpoint interval in one call
            ours, floor = draftflow_run(engine, requests, params, len(requests)), raw_vllm_run(engine, requests, params)
            what = "bare vllm.LLM.generate, same LLM and SamplingParams"
        else:
            ours = draftflow_run(engine, requests, params, rcfg.batch_size)
            floor = raw_hf_run(engine, requests, params, rcfg.batch_size)
            what = "plain HF model.generate, left-padded batches (hf fallback)"
        rates = best_of(ours, floor, repeats)
        step = len(requests) if use_vllm else rcfg.batch_size
        completions = [c.ids or [] for i in range(0, len(requests), step)
                       for c in engine.generate(requests[i:i + step], params)]
    finally:
        if use_vllm:
            engine.close()  # frees its memory and its engine process before the transformers stages
    return Row(f"regenerate ({rcfg.engine})", *rates, what), completions


# ----------------------------------------------------------------------------- extract


def extract_row(cfg: RunConfig, path: str, model, seqs: list[list[int]],
                repeats: int) -> tuple[Row, list[torch.Tensor]]:
    """The extract row, and the captured (T_i, n_taps, D) features of every sequence."""
    layer_ids = feature_ids(cfg.drafter, target_depth(path))
    engine = make_capture_engine(cfg.extract.engine, path, layer_ids, cfg.target.dtype, cfg.target.device,
                                 cfg.regenerate.vllm)
    size, tokens, feats = cfg.extract.batch_size, sum(map(len, seqs)), []
    ordered = sorted(seqs, key=len)  # capture_in_batches' batches
    device = model.get_input_embeddings().weight.device

    def ours() -> int:
        feats[:] = capture_in_batches(engine, seqs, size)[0]
        return tokens

    @torch.no_grad()
    def floor() -> int:
        for i in range(0, len(ordered), size):
            ids, mask = right_pad(ordered[i:i + size], device)
            model(input_ids=ids, attention_mask=mask, use_cache=False)
        return tokens

    rates = best_of(ours, floor, repeats)
    what = f"plain model(input_ids) forward (all layers + LM head), batches of {size}"
    return Row(f"extract ({engine.name}, taps {layer_ids})", *rates, what), list(feats)


# ----------------------------------------------------------------------------- train


def new_drafter(cfg: RunConfig, model, tokenizer, folder: str | None):
    """A fresh drafter of the config's kind around the target (seeded), or the one saved in `folder`."""
    spec = spec_for_architecture(read_weights_and_config(folder)[0].get("architecture")) if folder \
        else drafter_spec(cfg.drafter.kind)
    if spec.model is not drafter_spec("dflash").model:
        raise SystemExit(f"error: stage_floors' train floor drives DFlash block batches, not {spec.kind} drafters")
    if folder:
        return spec.model.load(folder, model)
    rows = model.get_input_embeddings().num_embeddings
    inputs = DraftInputs(mask_token_id=mask_token_id(tokenizer, rows))
    torch.manual_seed(cfg.train.seed)
    return spec.build(spec.config_from_target(model.config, cfg.drafter, inputs), model, None)


def samples_of(seqs: list[list[int]], prompt_lens: list[int], feats: list[torch.Tensor],
               dtype: str) -> list[FeatureSample]:
    """Training samples as the train stage reads them: completion tokens supervised, features as stored."""
    return [FeatureSample(f"s{i}", torch.tensor(s), torch.arange(len(s)) >= n, as_stored(f, dtype))
            for i, (s, n, f) in enumerate(zip(seqs, prompt_lens, feats))]


def train_row(cfg: RunConfig, drafter, samples: list[FeatureSample], steps: int, repeats: int) -> Row:
    tcfg, device = cfg.train, drafter.lm_head.weight.device
    drafter = prepare_model(drafter.train(), tcfg, DistEnv(), device)  # bf16 autocast on CUDA, as the stage
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = adamw(params, tcfg)  # the train stage's optimizer
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(1, 10**6))
    spec = spec_for_architecture(drafter.config.architecture)
    run = _Run(drafter, opt, sched, samples, tcfg, spec.objective(drafter.config, tcfg), steps, "", {}, device,
               DistEnv(), None)
    plan = [[(j, samples[(k * tcfg.batch_size + j) % len(samples)]) for j in range(tcfg.batch_size)]
            for k in range(steps)]
    blocks = [[(b.to(device), s.input_ids[b.block_pos[0]].to(device)) for j, s in seqs
               if (b := run.objective.batch(s, k, j)) is not None] for k, seqs in enumerate(plan)]
    supervised = sum(int((b.labels != IGNORE).sum()) for step in blocks for b, _ in step)
    if supervised == 0:
        raise SystemExit("error: no block fits in a completion: raise --max-new-tokens above drafter.block_size")
    floor_opt = adamw(params, tcfg)

    def ours() -> int:
        return sum(int(sum(_train_step(run, seqs, k)["valid"])) for k, seqs in enumerate(plan))

    def floor() -> int:
        for step in blocks:
            floor_opt.zero_grad(set_to_none=True)
            for b, every_slot in step:
                logits = drafter(b.block_ids, b.block_pos, b.ctx_hidden, b.ctx_pos, b.attn_mask)  # (1, Q, V)
                F.cross_entropy(logits[0].float(), every_slot).backward()
            floor_opt.step()
        return supervised

    rates = best_of(ours, floor, repeats)
    what = (f"drafter fwd + CE on all slots + bwd + AdamW, same blocks prebuilt ({steps} step(s) of "
            f"{tcfg.batch_size} seqs, <= {tcfg.num_anchors} anchors each)")
    return Row(f"train ({drafter.config.architecture})", *rates, what)


# ----------------------------------------------------------------------------- evaluate


def evaluate_row(cfg: RunConfig, model, tokenizer, drafter, prompts: list[list[int]], max_new: int,
                 repeats: int, trained: bool) -> Row:
    eos, accept = eos_token_ids(model, tokenizer), []
    drafter.eval()
    rounding = functools.partial(round_trip, dtype=cfg.extract.dtype, n_taps=len(drafter.config.target_layer_ids))

    @torch.no_grad()
    def ours() -> int:
        outs = [speculative_generate_cached(model, drafter, p, max_new, eos, rounding) for p in prompts]
        accept[:] = [a for _, steps in outs for a in steps]
        return sum(len(tokens) for tokens, _ in outs)

    def floor() -> int:
        return sum(len(greedy_generate_cached(model, p, max_new, eos)) for p in prompts)

    rates = best_of(ours, floor, repeats)
    tau = sum(accept) / max(len(accept), 1)
    bound = "trained drafter" if trained else "untrained drafter: the ratio is a lower bound"
    what = f"greedy, same KV-cached loop; tau {tau:.2f}, {bound}"
    return Row("evaluate (KV-cached spec.)", *rates, what)


# ----------------------------------------------------------------------------- the run


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), cpu)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (f"{cpu}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, {gpu}, torch "
            f"{torch.__version__}")


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def print_table(rows: list[Row]) -> None:
    print(f"{'stage':<38} | {'draftflow tokens/s':>18} | {'floor tokens/s':>14} | {'ratio':>6} | what the floor is")
    for r in rows:
        print(f"{r.stage:<38} | {r.ours:>18,.1f} | {r.floor:>14,.1f} | {r.ours / r.floor:>6.3f} | {r.what}")


def bench(args: argparse.Namespace) -> None:
    cfg = load_config(args.config, args.set)
    start = load()
    path = resolve_target(cfg.target).path
    requests = synthetic_requests(path, args.prompts)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)  # greedy: every run yields the same tokens
    rows = []
    row, completions = regenerate_row(cfg, path, requests, params, args.repeats)
    rows.append(row)
    model, tokenizer = load_target(path, cfg.target.dtype, cfg.target.device)
    seqs = [r.prompt_ids + c for r, c in zip(requests, completions)]
    row, feats = extract_row(cfg, path, model, seqs, args.repeats)
    rows.append(row)
    drafter = new_drafter(cfg, model, tokenizer, args.drafter)
    prompts = [r.prompt_ids for r in requests[: args.eval_prompts]]
    # Evaluate before train steps the drafter: it decodes with the weights it was built or loaded with.
    evaluated = evaluate_row(cfg, model, tokenizer, drafter, prompts, args.max_new_tokens, args.repeats,
                             bool(args.drafter))
    samples = samples_of(seqs, [len(r.prompt_ids) for r in requests], feats, cfg.extract.dtype)
    rows += [train_row(cfg, drafter, samples, args.train_steps, args.repeats), evaluated]
    print(f"\nstage floors: {cfg.name}, target {path}, {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"machine: {machine()}; {start} at start, {load()} at end")
    print(f"{len(requests)} prompts (mean {sum(len(r.prompt_ids) for r in requests) // len(requests)} tokens), "
          f"{args.max_new_tokens} new tokens max, {args.train_steps} train steps, {len(prompts)} eval prompts, "
          f"best of {args.repeats} after a warm-up\n")
    print_table(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="run config (its target, engines, drafter and train section)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="dotted config override")
    ap.add_argument("--prompts", type=int, default=8, help="synthetic chats regenerated, then extracted and trained on")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="per completion, regenerate and evaluate")
    ap.add_argument("--train-steps", type=int, default=2, help="optimizer steps per timed train run")
    ap.add_argument("--eval-prompts", type=int, default=2, help="prompts decoded per timed evaluate run")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of each side; the best counts")
    ap.add_argument("--drafter", help="a trained drafter folder (model.safetensors + config.json) to train "
                                      "and evaluate instead of a fresh one")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.set_num_threads(int(os.environ.get("DRAFTFLOW_TORCH_THREADS", torch.get_num_threads())))
    run_cli(bench, parse_args(argv))


if __name__ == "__main__":
    main()
