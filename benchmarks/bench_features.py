"""Feature-shard reads: memory-mapped random access by sample id vs loading the whole shard.

Prints the time per sample read both ways and their ratio, measured in the same run.
Also prints bytes on disk per token against taps x width x dtype size.
Usage: python benchmarks/bench_features.py [--samples 2000] [--tokens 256] [--width 1024] [--dtype float8]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftflow.features import STORED, FeatureSample, FeatureShard, write_feature_shard


def make_shard(path: Path, n: int, tokens: int, width: int, dtype: str) -> list[str]:
    samples = [FeatureSample(f"s{i}", torch.randint(0, 1000, (tokens,)), torch.ones(tokens, dtype=torch.bool),
                             torch.randn(tokens, 3, width).to(torch.bfloat16)) for i in range(n)]
    write_feature_shard(path, samples, [1, 2, 3], dtype)
    return [s.sample_id for s in samples]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--reads", type=int, default=50)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(STORED))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "shard.safetensors"
        ids = make_shard(path, args.samples, args.tokens, args.width, args.dtype)
        picks = random.Random(0).sample(ids, args.reads)
        t0 = time.perf_counter()
        shard = FeatureShard(path)
        for sid in picks:
            shard.get(sid).hidden.clone()  # fp8 dequantizes to bf16 here
        mmap_s = (time.perf_counter() - t0) / args.reads
        t0 = time.perf_counter()
        for _ in range(3):  # baseline: read the whole shard into memory, then take one sample
            whole = {k: v.clone() for k, v in load_file(str(path)).items()}
            whole["hidden_states"][: args.tokens].clone()
        full_s = (time.perf_counter() - t0) / 3
        size_gb = path.stat().st_size / 1e9
        per_token = path.stat().st_size / (args.samples * args.tokens)
        raw = 3 * args.width * torch.empty((), dtype=STORED[args.dtype]).element_size()
    print(f"shard {size_gb:.2f} GB, {args.samples} samples, {args.dtype}")
    print(f"bytes per token: {per_token:.1f} vs raw {raw} (3 taps x {args.width}): {per_token / raw:.4f}x")
    print(f"random read by sample id (mmap): {mmap_s * 1e3:8.2f} ms/sample")
    print(f"load whole shard, take one:      {full_s * 1e3:8.2f} ms/sample (baseline)")
    print(f"speedup: {full_s / mmap_s:.1f}x")


if __name__ == "__main__":
    main()
