"""Feature-store throughput against raw sequential I/O of the same bytes on the same disk, same run.

Writes >= 2 GB of synthetic bf16 features as feature shards (`write_feature_shard`) and reads
them back the way the training loop does: through `FeatureReader.take`, one step's samples at a
time, in the order of `step_indices` (a seeded shuffle of every sample, cut in batches), the next
step's samples read by the reader threads meanwhile. A pread delivers every byte into memory, so
nothing is touched again (a sum over the features would time the CPU, not the store). `--verify`
adds a read that checks every sample against its sha256 in the index, as training does on v3
shards (CPU-bound where hashing is slower than the disk).

Baselines, same run: raw write = the same number of bytes written in 8 MiB blocks to a new file;
raw read = the shard files themselves read front to back in 8 MiB blocks (the same blocks on disk,
so only the access pattern differs; a separate file read faster or slower than the shards on this
VM's disk, by up to 4x either way). Prints MB/s and the ratio store/raw for both (target >= 0.8),
per repeat (store and raw interleaved, so load from other users hits both alike) and the median.
The order is store, raw, store, raw: on this VM a read can be served partly by the host's cache,
which the guest cannot evict, and two sequential reads of the same bytes in a row ran at up to
3 GB/s against ~2 GB/s otherwise; in S R S R every read follows one of the other side.

Reads are cold by default, and the output says how: `drop_caches` (root with a writable
/proc/sys/vm/drop_caches), else `fadvise` (posix_fadvise DONTNEED of every file after fsync,
which evicts clean pages without root; checked with mincore: the resident share is printed).
When neither evicts, the line says `warm` with the resident share: the figures then measure
memory. `--warm` skips eviction on purpose.

`--extract` instead times capture (hooks on the taps, forward stopped after the last tap) against
the target's plain forward at the same batch shape: run it on a GPU machine with a real model
(`--model Qwen/Qwen3-8B --batch 8 --seq 2048`, or `--random-qwen3-8b` where nothing can be
downloaded); the target is >= 0.7x the plain forward.

Run as a module: `python -m benchmarks.feature_store [--gb 2] [--extract]`.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from draftflow.config import TrainConfig
from draftflow.drafters.batches import step_indices
from draftflow.feature_stream import FeatureReader
from draftflow.features import FeatureSample, FeatureShard, write_feature_shard

BLOCK = 8 << 20
TRAIN_BATCH = 8  # sequences per step in the read order


def _samples(n: int, tokens: int, taps: int, width: int) -> list[FeatureSample]:
    g = torch.Generator().manual_seed(0)
    return [FeatureSample(f"s{i}", torch.randint(0, 1000, (tokens,), generator=g), torch.ones(tokens, dtype=torch.bool),
                          torch.randn(tokens, taps, width, generator=g).to(torch.bfloat16)) for i in range(n)]


# -- cold reads ----------------------------------------------------------------------------------
def resident(paths: list[Path]) -> float:
    """Share of the files' pages in the page cache (mincore over a read-only mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page, total, cached = mmap.PAGESIZE, 0, 0
    for p in paths:
        size = p.stat().st_size
        if not size:
            continue
        # ACCESS_COPY: ctypes takes the address of writable buffers only; nothing is written.
        with open(p, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
            n = (size + page - 1) // page
            vec = (ctypes.c_ubyte * n)()
            if libc.mincore(ctypes.c_void_p(_address(mm)), ctypes.c_size_t(size), vec) != 0:
                return float("nan")
            total, cached = total + n, cached + sum(b & 1 for b in vec)
    return cached / max(total, 1)


def _address(mm: mmap.mmap) -> int:
    """Start address of a mapping (the buffer export is released before the mapping closes)."""
    buf = (ctypes.c_char * 1).from_buffer(mm)
    addr = ctypes.addressof(buf)
    del buf
    return addr


def evict(paths: list[Path], warm: bool) -> str:
    """Make the next read of `paths` come from disk; return how (and the resident share left)."""
    if warm:
        return f"warm (--warm), {resident(paths):.0%} resident"
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        method = "drop_caches"
    except OSError:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        method = "fadvise"
    left = resident(paths)
    if left < 0.05:
        return f"{method}, {left:.0%} resident"
    return f"warm (eviction by {method} failed), {left:.0%} resident"


# -- the two sides -------------------------------------------------------------------------------
def store_write(folder: Path, shards: int, samples: list[FeatureSample]) -> tuple[float, list[Path]]:
    t0 = time.perf_counter()
    paths = []
    for k in range(shards):
        paths.append(folder / f"shard-{k}.safetensors")
        write_feature_shard(paths[-1], samples, [1, 2, 3])
    os.sync()
    return time.perf_counter() - t0, paths


def store_read(paths: list[Path], verify: bool = False) -> float:
    """Seconds to read every sample as the training loop does: one step's batch at a time, shuffled,
    the next step's read by the reader threads meanwhile; with `verify`, each sample checked against
    its sha256 in the index (what training does on format v3 shards)."""
    t0 = time.perf_counter()
    shards = [FeatureShard(p) for p in paths]
    source = FeatureReader(shards, [verify] * len(shards))
    tcfg = TrainConfig(batch_size=TRAIN_BATCH, seed=0)
    steps = -(-len(source) // TRAIN_BATCH)
    for step in range(steps):
        batch = source.take(step_indices(step, len(source), tcfg, source.lengths))
        if step + 1 < steps:
            source.prefetch(step_indices(step + 1, len(source), tcfg, source.lengths))
        assert sum(s.hidden.numel() for s in batch) > 0  # the bytes are in memory: pread copied them there
    return time.perf_counter() - t0


def raw_write(path: Path, nbytes: int) -> float:
    block = os.urandom(BLOCK)
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        for _ in range(-(-nbytes // BLOCK)):
            fh.write(block)
    os.sync()
    return time.perf_counter() - t0


def raw_read(paths: list[Path], block: int = BLOCK) -> float:
    """Seconds to read the files front to back in `block`s: the disk's sequential speed on these bytes."""
    buf = bytearray(block)
    t0 = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    return time.perf_counter() - t0


def bench_store(args) -> None:
    taps, width, tokens = 3, 2048, 1024
    per_sample = tokens * taps * width * 2
    n = max(1, min((256 << 20) // per_sample, int(args.gb * (1 << 30)) // per_sample))  # ~256 MB per shard
    samples = _samples(n, tokens, taps, width)
    shards = max(1, -(-int(args.gb * (1 << 30)) // (n * per_sample)))
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        folder = Path(d)
        sw, paths = store_write(folder, shards, samples)
        del samples
        nbytes = sum(p.stat().st_size for p in paths)
        rw = raw_write(folder / "raw.bin", nbytes)
        mb = nbytes / 1e6
        print(f"{mb:,.0f} MB in {shards} shards ({taps} taps x {width} bf16, {tokens} tokens/sample), "
              f"reads: {TRAIN_BATCH}-sample steps in step_indices order")
        print(f"write: store {mb / sw:8.0f} MB/s   raw {mb / rw:8.0f} MB/s   ratio {rw / sw:.2f}")
        ratios = []
        for r in range(args.repeats or 2):
            sides = {"store": lambda: store_read(paths), "raw": lambda: raw_read(paths, args.raw_block_mb << 20)}
            secs, how = {}, {}
            for side in ("store", "raw"):  # S R S R: each read follows one of the other side (see the docstring)
                how[side] = evict(paths, args.warm)
                secs[side] = sides[side]()
            sr, rr = secs["store"], secs["raw"]
            ratios.append(rr / sr)
            print(f"read {r}: store {mb / sr:8.0f} MB/s   raw {mb / rr:8.0f} MB/s   ratio {rr / sr:.2f}   "
                  f"[store: {how['store']}; raw: {how['raw']}]")
            if args.verify:
                how_v = evict(paths, args.warm)
                sv = store_read(paths, verify=True)
                print(f"read {r} verified per sample: store {mb / sv:8.0f} MB/s   ratio {rr / sv:.2f}   [{how_v}]")
        print(f"read ratio {statistics.median(ratios):.2f} (median of {len(ratios)}), write ratio {rw / sw:.2f}; "
              f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")


def bench_extract(args) -> None:
    from draftflow.config import TargetConfig
    from draftflow.drafters.dflash.taps import default_dflash_layer_ids
    from draftflow.engines.capture import HFCapture
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
    times, repeats = {}, args.repeats or 5
    for name, fn in (("plain forward", plain), ("capture", lambda: cap.capture(batch))):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times[name] = (time.perf_counter() - t0) / repeats
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
    ap.add_argument("--warm", action="store_true", help="store reads: skip page-cache eviction (measures memory)")
    ap.add_argument("--raw-block-mb", type=int, default=8, help="block size of the raw sequential read")
    ap.add_argument("--verify", action="store_true", help="also read with per-sample sha256 checks (CPU-bound)")
    ap.add_argument("--drop-caches", action="store_true", help="accepted for old scripts: cold is the default")
    ap.add_argument("--extract", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--random-qwen3-8b", action="store_true", help="Qwen3-8B's shape, random weights (no download)")
    ap.add_argument("--layers", type=int, default=None, help="with --random-qwen3-8b: fewer layers (smoke runs)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=None, help="default: 5 (--extract), 2 (store reads)")
    args = ap.parse_args()
    bench_extract(args) if args.extract else bench_store(args)


if __name__ == "__main__":
    main()
