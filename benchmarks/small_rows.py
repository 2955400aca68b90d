"""A target's KV-cached forward of a few positions (a speculative verify step) on the CPU: torch's plain
`nn.Linear` (the baseline every ratio is against, measured in the same run) against `SmallRowsLinear`.

For each row count it feeds that many positions after a 200-token prefix, crops them off again, and prints the
milliseconds per forward of both and their ratio; then whether a 48-token greedy decode gives the same tokens
with and without the swap (it changes rounding):

    python -m benchmarks.small_rows configs/smollm2.yaml [--rows 1,2,3,4,8] [--repeats 20]

Default config: configs/tiny.yaml (the demo's tiny target). A measurement of this machine under its load, not a
test; docs/results.md "Speed on a CPU" has the figures.
"""

from __future__ import annotations

import argparse
import copy
import time


def per_forward_ms(model, rows: int, repeats: int) -> float:
    """Milliseconds per cached forward of `rows` positions after a 200-token prefix (cropped back each time)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.arange(100, 300)[None], past_key_values=cache, use_cache=True)
        step = torch.arange(5, 5 + rows)[None]
        model(input_ids=step, past_key_values=cache, use_cache=True)  # warm-up
        cache.crop(-rows)
        start = time.perf_counter()
        for _ in range(repeats):
            model(input_ids=step, past_key_values=cache, use_cache=True)
            cache.crop(-rows)
    return (time.perf_counter() - start) / repeats * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default="configs/tiny.yaml")
    ap.add_argument("--rows", default="1,2,3,4,8")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    import torch

    from draftflow.config import load_config
    from draftflow.evaluation.cached import greedy_generate_cached
    from draftflow.small_rows import SmallRowsLinear
    from draftflow.target import load_target, resolve_target

    cfg = load_config(args.config, [])
    swapped, _ = load_target(resolve_target(cfg.target).path, cfg.target.dtype, "cpu")  # as every stage gets it
    n = sum(type(m) is SmallRowsLinear for m in swapped.modules())
    print(f"{n} of {sum(isinstance(m, torch.nn.Linear) for m in swapped.modules())} linear layers swapped "
          "(weights of 1 MiB or more)")
    plain = copy.deepcopy(swapped)
    for sub in plain.modules():
        if type(sub) is SmallRowsLinear:
            sub.__class__ = torch.nn.Linear  # the baseline: torch's own layer
    for rows in (int(r) for r in args.rows.split(",")):
        base = per_forward_ms(plain, rows, args.repeats)
        fast = per_forward_ms(swapped, rows, args.repeats)
        print(f"rows {rows}: nn.Linear {base:.1f} ms, SmallRowsLinear {fast:.1f} ms, ratio {base / fast:.2f}")
    prompt = list(range(100, 164))
    same = greedy_generate_cached(plain, prompt, 48, set()) == greedy_generate_cached(swapped, prompt, 48, set())
    print(f"greedy tokens equal with and without the swap: {same}")


if __name__ == "__main__":
    main()
