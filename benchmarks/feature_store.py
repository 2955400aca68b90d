"""Feature-store throughput against raw sequential I/O of the same bytes on the same disk, same run.

Writes >= 2 GB of synthetic bf16 features as feature shards (`write_feature_shard`) and reads
them back sample by sample through `FeatureShard` (every tensor materialized), next to a raw
sequential write and read of the same number of bytes in 8 MiB blocks. Prints MB/s and the
ratio store/raw for both (target >= 0.8). Reads after writes may be served from the page cache
for both sides alike; pass `--drop-caches` (root, Linux) to read from disk.

`--extract` instead times capture (hooks on the taps, forward stopped after the last tap) against
the target's plain forward at the same batch shape: run it on a GPU machine with a real model
(`--model Qwen/Qwen3-8B --batch 8 --seq 2048`, or `--random-qwen3-8b` where nothing can be
downloaded); the target is >= 0.7x the plain forward.

Run as a module: `python -m benchmarks.feature_store [--gb 2] [--extract]`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from draftflow.features import FeatureSample, FeatureShard, write_feature_shard

BLOCK = 8 << 20


def _samples(n: int, tokens: int, taps: int, width: int) -> list[FeatureSample]:
    g = torch.Generator().manual_seed(0)
    return [FeatureSample(f"s{i}", torch.randint(0, 1000, (tokens,), generator=g), torch.ones(tokens, dtype=torch.bool),
                          torch.randn(tokens, taps, width, generator=g).to(torch.bfloat16)) for i in range(n)]


def _drop_caches(enabled: bool) -> None:
    if enabled:
        os.sync()
        subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], check=False)


def store_io(folder: Path, shards: int, samples: list[FeatureSample], drop: bool) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    paths = []
    for k in range(shards):
        paths.append(folder / f"shard-{k}.safetensors")
        write_feature_shard(paths[-1], samples, [1, 2, 3])
    os.sync()
    write_s = time.perf_counter() - t0
    nbytes = sum(p.stat().st_size for p in paths)
    _drop_caches(drop)
    t0 = time.perf_counter()
    for p in paths:
        for s in FeatureShard(p):
            s.hidden.clone(), s.input_ids.clone(), s.loss_mask.clone()
    return write_s, time.perf_counter() - t0, nbytes


def raw_io(path: Path, nbytes: int, drop: bool) -> tuple[float, float]:
    block = os.urandom(BLOCK)
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        for _ in range(nbytes // BLOCK + 1):
            fh.write(block)
    os.sync()
    write_s = time.perf_counter() - t0
    _drop_caches(drop)
    t0 = time.perf_counter()
    with open(path, "rb") as fh:
        while fh.read(BLOCK):
            pass
    return write_s, time.perf_counter() - t0


def bench_store(args) -> None:
    taps, width, tokens = 3, 2048, 1024
    per_sample = tokens * taps * width * 2
    samples = _samples(max(1, (256 << 20) // per_sample), tokens, taps, width)  # ~256 MB per shard
    shards = max(1, int(args.gb * (1 << 30)) // (len(samples) * per_sample) + 1)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        sw, sr, nbytes = store_io(Path(d), shards, samples, args.drop_caches)
        rw, rr = raw_io(Path(d) / "raw.bin", nbytes, args.drop_caches)
    mb = nbytes / 1e6
    print(f"{mb:,.0f} MB in {shards} shards ({taps} taps x {width} bf16, {tokens} tokens/sample)")
    print(f"write: store {mb / sw:8.0f} MB/s   raw {mb / rw:8.0f} MB/s   ratio {rw / sw:.2f}")
    print(f"read:  store {mb / sr:8.0f} MB/s   raw {mb / rr:8.0f} MB/s   ratio {rr / sr:.2f}")


def bench_extract(args) -> None:
    from draftflow.capture import HFCapture
    from draftflow.config import TargetConfig
    from draftflow.layers import default_dflash_layer_ids
    from draftflow.target import load_target, resolve_target

    if args.random_qwen3_8b:
        model = random_qwen3_8b(args.layers)
    else:
        model, _ = load_target(args.model or resolve_target(TargetConfig()).path)
    n_layers = model.config.num_hidden_layers
    layer_ids = default_dflash_layer_ids(n_layers, 5 if n_layers > 8 else 3)
    vocab = model.get_input_embeddings().weight.shape[0]
    batch = torch.randint(0, min(1000, vocab), (args.batch, args.seq)).tolist()
    ids = torch.tensor(batch, device=model.device)
    cap = HFCapture(model, layer_ids)

    def plain():
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)

    for fn in (plain, lambda: cap.capture(batch)):  # warm up
        fn()
    times = {}
    for name, fn in (("plain forward", plain), ("capture", lambda: cap.capture(batch))):
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times[name] = (time.perf_counter() - t0) / args.repeats
    tokens = args.batch * args.seq
    for name, s in times.items():
        print(f"{name:<14} {tokens / s:10.0f} tok/s")
    print(f"ratio capture/plain {times['plain forward'] / times['capture']:.2f} (taps {layer_ids})")


def random_qwen3_8b(layers: int | None = None):
    """Qwen3-8B's shape (config.json of Qwen/Qwen3-8B) with random bf16 weights, built on the GPU.

    For machines that cannot download the model: the timing of a forward pass depends on the
    shape, not on the weights. `layers` trims the depth for a quick CPU smoke run.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=layers or 36,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                      max_position_embeddings=40960, rope_theta=1_000_000.0, tie_word_embeddings=False)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    return model.eval()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--dir", default=None, help="folder on the disk to measure (default: the temp dir)")
    ap.add_argument("--drop-caches", action="store_true")
    ap.add_argument("--extract", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--random-qwen3-8b", action="store_true", help="Qwen3-8B's shape, random weights (no download)")
    ap.add_argument("--layers", type=int, default=None, help="with --random-qwen3-8b: fewer layers (smoke runs)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    bench_extract(args) if args.extract else bench_store(args)


if __name__ == "__main__":
    main()
