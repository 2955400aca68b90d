"""Feature-shard reads: memory-mapped random access by sample id vs loading the whole shard.

Prints the time per sample read both ways and their ratio, measured in the same run.
Usage: python benchmarks/bench_features.py [--samples 2000] [--tokens 256] [--width 1024]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftflow.features import FeatureSample, FeatureShard, write_feature_shard


def make_shard(path: Path, n: int, tokens: int, width: int) -> list[str]:
    samples = [FeatureSample(f"s{i}", torch.randint(0, 1000, (tokens,)), torch.ones(tokens, dtype=torch.bool),
                             torch.randn(tokens, 3, width).to(torch.bfloat16)) for i in range(n)]
    write_feature_shard(path, samples, [1, 2, 3])
    return [s.sample_id for s in samples]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--reads", type=int, default=50)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "shard.safetensors"
        ids = make_shard(path, args.samples, args.tokens, args.width)
        picks = random.Random(0).sample(ids, args.reads)
        t0 = time.perf_counter()
        shard = FeatureShard(path)
        for sid in picks:
            shard.get(sid).hidden.clone()
        mmap_s = (time.perf_counter() - t0) / args.reads
        t0 = time.perf_counter()
        for _ in range(3):  # baseline: read the whole shard into memory, then take one sample
            whole = {k: v.clone() for k, v in load_file(str(path)).items()}
            whole["hidden_states"][: args.tokens].clone()
        full_s = (time.perf_counter() - t0) / 3
        size_gb = path.stat().st_size / 1e9
    print(f"shard {size_gb:.2f} GB, {args.samples} samples")
    print(f"random read by sample id (mmap): {mmap_s * 1e3:8.2f} ms/sample")
    print(f"load whole shard, take one:      {full_s * 1e3:8.2f} ms/sample (baseline)")
    print(f"speedup: {full_s / mmap_s:.1f}x")


if __name__ == "__main__":
    main()
