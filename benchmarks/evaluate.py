"""KV-cached vs uncached speculative decoding: per-token cost against sequence length, in one run.

Builds a small random Qwen3 target in code (float32, no download) and an untrained drafter of
each kind asked for, then generates `--tokens` tokens from one prompt twice: with the uncached
reference loop (`draftflow.evaluation.decode.speculative_generate`, the whole target re-run every
step, O(T^2)) and with the KV-cached loop (`draftflow.evaluation.cached`). eos is disabled, so
both generate exactly `--tokens` tokens, and the two outputs must be equal. Every target call is
stamped with this process's CPU time (`time.process_time`: on a shared, loaded machine it counts
the work, not the wait for a core; totals are wall time); a step's cost (drafting + verifying +
acceptance) is the time between two calls, and the per-token cost near length L is the cost of
the steps in the last `--window` generated tokens before L over the tokens they kept. The ratio
at the longest length is the headline (goal: cached per-token cost flat in length, >= 5x cheaper
at 1k tokens). Both loops run at every length in the same run; nothing is extrapolated.

    python -m benchmarks.evaluate                      # DFlash, 1024 tokens: ~40 s CPU (minutes if loaded)
    python -m benchmarks.evaluate --kind eagle3 --tokens 512
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from draftflow.config import DrafterConfig
from draftflow.drafters.dflash.config import DFlashConfig
from draftflow.drafters.dflash.model import DFlashDrafter
from draftflow.drafters.eagle3.config import Eagle3Config
from draftflow.drafters.eagle3.model import Eagle3Drafter
from draftflow.evaluation.cached import speculative_generate_cached
from draftflow.evaluation.decode import speculative_generate


class TimedTarget:
    """The target, with the time and sequence length of every forward call recorded."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, input_ids, past_key_values=None, **kw):
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        self.calls.append((time.process_time(), past + input_ids.shape[1]))
        return self.model(input_ids=input_ids, past_key_values=past_key_values, **kw)


def build(args) -> tuple[torch.nn.Module, dict[str, torch.nn.Module]]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.hidden // 4,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    )
    target = Qwen3ForCausalLM(cfg).eval()
    taps = [0, (args.layers - 2) // 2, args.layers - 2]  # the last layer is not a tap (`draftflow.layers`)
    drafters = {}
    if args.kind in ("dflash", "both"):
        dcfg = DFlashConfig.from_target(
            cfg, DrafterConfig(num_layers=1, block_size=args.block, num_taps=3, target_layer_ids=taps), args.vocab - 1
        )
        drafters["dflash"] = DFlashDrafter(dcfg, target).eval()
    if args.kind in ("eagle3", "both"):
        ecfg = Eagle3Config.from_target(
            cfg, DrafterConfig(kind="eagle3", target_layer_ids=taps, ttt_steps=args.block - 1), args.vocab // 2
        )
        drafters["eagle3"] = Eagle3Drafter(ecfg, target).eval()
    return target, drafters


def per_token_cost(calls: list[tuple[float, int]], accept: list[int], at: int, window: int) -> float:
    """Seconds per kept token over the steps whose first generated position lies in (at - window, at]."""
    secs = toks = 0.0
    for (t0, _), (t1, _), kept, start in zip(calls[1:], calls[2:], accept, _starts(accept)):
        if at - window < start <= at:
            secs, toks = secs + (t1 - t0), toks + kept
    return secs / max(toks, 1)


def _starts(accept: list[int]) -> list[int]:
    """Generated-token index at which each step starts (token 0 comes from prefill)."""
    out, n = [], 1
    for a in accept:
        out.append(n)
        n += a
    return out


def run_one(name: str, target, drafter, args) -> None:
    prompt = torch.randint(0, args.vocab - 1, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    results = {}
    for label, loop in (("uncached", speculative_generate), ("cached", speculative_generate_cached)):
        timed = TimedTarget(target)
        t0 = time.perf_counter()
        tokens, accept = loop(timed, drafter, prompt, args.tokens, set())  # eos disabled: exactly --tokens
        timed.calls.append((time.process_time(), 0))  # closes the last step
        results[label] = (tokens, accept, timed.calls, time.perf_counter() - t0)
    same = results["uncached"][:2] == results["cached"][:2]
    steps, tau = len(results["cached"][1]), sum(results["cached"][1]) / max(len(results["cached"][1]), 1)
    print(
        f"\n{name}: {args.tokens} tokens from a {args.prompt}-token prompt, {steps} steps, tau {tau:.3f}, "
        f"same tokens and steps: {'yes' if same else 'NO'}"
    )
    print(f"total wall time: uncached {results['uncached'][3]:.1f} s, cached {results['cached'][3]:.1f} s")
    print(f"{'length':>8} {'uncached CPU ms/token':>22} {'cached CPU ms/token':>20} {'ratio':>7}")
    lengths = [n for n in (128, 256, 512, 1024, 2048) if n < args.tokens] + [args.tokens]
    ratio = 0.0
    for n in lengths:
        u, c = (per_token_cost(results[k][2], results[k][1], n, args.window) for k in ("uncached", "cached"))
        ratio = u / c
        print(f"{n:>8} {u * 1e3:>22.2f} {c * 1e3:>20.2f} {ratio:>6.1f}x")
    print(f"{name} ratio at {args.tokens} tokens: {ratio:.1f}x (cached over uncached per-token speed)")
    if not same:
        raise SystemExit(f"{name}: cached decoding differs from the uncached reference")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=["dflash", "eagle3", "both"], default="dflash")
    ap.add_argument("--tokens", type=int, default=1024, help="generated tokens (eos disabled)")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--window", type=int, default=128, help="tokens per per-token-cost reading")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4, help=">= 4 (three distinct taps)")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--block", type=int, default=8, help="DFlash block size; EAGLE-3 chain = block - 1")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("DRAFTFLOW_TORCH_THREADS", "1")))
    target, drafters = build(args)
    print(
        f"target: Qwen3 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, float32, "
        f"{torch.get_num_threads()} torch thread(s), load average {os.getloadavg()[0]:.1f}"
    )
    with torch.no_grad():
        for name, drafter in drafters.items():
            run_one(name, target, drafter, args)


if __name__ == "__main__":
    main()
