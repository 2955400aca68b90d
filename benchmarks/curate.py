"""Curate-stage throughput and peak memory at scale, against a raw read baseline, same run.

Writes N synthetic rows (default 1M) as four sources in real formats: ShareGPT
(.jsonl.zst, split over 4 files), OpenAI messages with tool calls (.jsonl.gz),
Alpaca (parquet) and prompt-only rows (.jsonl), with ~5% exact duplicates and
~3% near duplicates. Then it runs the curate stage through the library
(`draftflow.stages.curate.run`: scans over worker processes, then the merge)
with near-dup removal on, and a raw baseline that only reads and JSON-parses
every row. Prints rows/s for both, stage/raw, and peak RSS of this process and
of the largest scan worker (the target: < 2 GB at 1M rows).

Usage: python -m benchmarks.curate [--rows 1000000] [--workers 2] [--near-dup 0.9] [--keep DIR]
(run as a module: `python benchmarks/curate.py` would put benchmarks/ first on sys.path,
where benchmarks/tokenize.py shadows the standard library module of that name)
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import resource
import shutil
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from draftflow.config import CurateConfig, SourceConfig, load_config
from draftflow.contracts import Stamp
from draftflow.data.readers import read_file, source_files
from draftflow.stages import curate
from draftflow.store import Store

WORDS = ("explain write compare list describe the a function loop tree graph prime number string python rust "
         "sort search merge cache thread lock queue model token draft verify block decode fast slow why how "
         "when city weather poem story summary table column row index key value").split()


def _text(i: int) -> str:
    r = random.Random(i)
    return f"{' '.join(r.choices(WORDS, k=r.randint(8, 60)))} #{i}"


def _prompt(i: int) -> str:
    if i % 20 == 0:
        return _text(i - 1)  # an exact duplicate of the previous row
    if i % 33 == 0:
        return _text(i - 1) + " please"  # a near duplicate of the previous row
    return _text(i)


def _sharegpt(i):
    return {"conversations": [{"from": "human", "value": _prompt(i)}, {"from": "gpt", "value": "answer " * 20}]}


def _openai(i):
    call = [{"id": f"c{i}", "type": "function", "function": {"name": "lookup", "arguments": "{\"q\": 1}"}}]
    return {"messages": [{"role": "user", "content": _prompt(i)},
                         {"role": "assistant", "content": None, "tool_calls": call},
                         {"role": "tool", "tool_call_id": f"c{i}", "content": "42"},
                         {"role": "assistant", "content": "It is 42."}],
            "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]}


def write_sources(folder: Path, rows: int) -> list[SourceConfig]:
    """Four sources holding `rows` rows in total (each over its own range of row numbers)."""
    q = rows // 4
    zc = zstandard.ZstdCompressor(level=3)
    for k in range(4):
        lines = "".join(json.dumps(_sharegpt(i)) + "\n" for i in range(k * q // 4 + 1, (k + 1) * q // 4 + 1))
        (folder / f"sharegpt-{k}.jsonl.zst").write_bytes(zc.compress(lines.encode()))
    with gzip.open(folder / "openai.jsonl.gz", "wt") as fh:
        for i in range(q + 1, 2 * q + 1):
            fh.write(json.dumps(_openai(i)) + "\n")
    prompts = [_prompt(i) for i in range(2 * q + 1, 3 * q + 1)]
    pq.write_table(pa.table({"instruction": prompts, "output": ["ok"] * q}), folder / "alpaca.parquet",
                   row_group_size=16384)
    with open(folder / "prompts.jsonl", "w") as fh:
        for i in range(3 * q + 1, rows + 1):
            fh.write(json.dumps({"prompt": _prompt(i)}) + "\n")
    return [SourceConfig(name="sharegpt", path=str(folder / "sharegpt-*.jsonl.zst")),
            SourceConfig(name="openai", path=str(folder / "openai.jsonl.gz")),
            SourceConfig(name="alpaca", path=str(folder / "alpaca.parquet")),
            SourceConfig(name="prompts", path=str(folder / "prompts.jsonl"))]


def raw_read(sources: list[SourceConfig]) -> int:
    """The baseline: stream and parse every row, nothing else."""
    return sum(1 for src in sources for f in source_files(src) for _ in read_file(f))


def _peak_mb(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # Linux: KiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--near-dup", type=float, default=0.9, help="0 turns near-dup removal off")
    ap.add_argument("--keep", type=Path, default=None, help="keep the sources and the run here")
    args = ap.parse_args()
    folder = args.keep or Path(tempfile.mkdtemp(prefix="draftflow-bench-curate-"))
    (folder / "src").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    sources = write_sources(folder / "src", args.rows)
    print(f"wrote {args.rows} rows in 4 sources ({time.perf_counter() - t0:.1f}s)")
    t0 = time.perf_counter()
    n = raw_read(sources)
    raw_s = time.perf_counter() - t0
    ccfg = CurateConfig(sources=sources, shard_rows=10_000, near_dup_threshold=args.near_dup or None)
    cfg = load_config(None, [f"root={folder / 'run'}"]).model_copy(update={"curate": ccfg})
    shutil.rmtree(folder / "run", ignore_errors=True)
    base = _peak_mb(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    into = Stamp(stage="curate", fingerprint="bench", inputs={}, config={})
    m = curate.run(Store(cfg.root), into, cfg, workers=args.workers)
    stage_s = time.perf_counter() - t0
    print(f"raw read+parse : {n / raw_s:10.0f} rows/s ({raw_s:.1f}s, one process)")
    print(f"curate stage   : {n / stage_s:10.0f} rows/s ({stage_s:.1f}s, {args.workers} scan workers, "
          f"near-dup {args.near_dup or 'off'})")
    print(f"stage/raw      : {raw_s / stage_s:.2f}x the raw read's throughput")
    print(f"rows in {m.rows_in}, out {m.rows_out}, dropped {m.dropped}, shards {len(m.shards)}")
    print(f"peak RSS       : main {_peak_mb(resource.RUSAGE_SELF):.0f} MB (before the stage {base:.0f} MB), "
          f"largest scan worker {_peak_mb(resource.RUSAGE_CHILDREN):.0f} MB")
    if args.keep is None:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
