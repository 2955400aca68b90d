"""Curation end to end through the library: filters, near-dup, mixture, determinism, readers, S3, HF."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from draftflow.config import CurateConfig, SourceConfig, load_config
from draftflow.data import dedup, mixture
from draftflow.data.schema import read_rows
from draftflow.stages import curate
from draftflow.store import Store
from tests.conftest import stamped

STAMP = stamped("curate", "fp", {})  # curate into <root>/curate/fp

FIX = Path(__file__).parent / "fixtures" / "sources"


def _cfg(root, **curate_fields):
    cfg = load_config(None, [f"root={root}"])
    return cfg.model_copy(update={"curate": CurateConfig(**curate_fields)})


def _rows(root, manifest, kind="shards"):
    return [r for s in getattr(manifest, kind) for r in read_rows(f"{root}/curate/fp/{s.name}")]


def _prompts(path: Path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return str(path)


def test_every_fixture_format_curates_with_reasons_and_accounting(tmp_path):
    sources = [SourceConfig(name=p.name.split(".")[0], path=str(p)) for p in sorted(FIX.iterdir())]
    m = curate.run(Store(str(tmp_path)), STAMP, _cfg(tmp_path, sources=sources, eval_fraction=0.2, shard_rows=3))
    assert m.rows_in == m.rows_out + sum(m.dropped.values()) == 28
    assert m.dropped == {"empty_prompt": 2, "invalid_utf8": 2, "malformed_json": 2, "non_text_content": 1,
                            "not_an_object": 1, "unknown_format": 1, "unknown_role": 2}
    rejects = _rows(tmp_path, m, "rejected")
    assert len(rejects) == sum(m.dropped.values()) and all(r["row"] for r in rejects)
    rows = _rows(tmp_path, m)
    assert all(s.rows <= 3 for s in m.shards) and {r["split"] for r in rows} == {"train", "eval"}
    tool_row = next(r for r in rows if r["tools"] and len(r["messages"]) == 5)
    assert tool_row["messages"][2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert (tmp_path / "curate" / "fp" / m.extra["histogram_png"]).read_bytes()[:4] == b"\x89PNG"
    assert set(m.extra["sources"]) == {s.name for s in sources}


def test_filters_chars_tokens_blocklist_charset(tmp_path, tiny_target):
    texts = ["ok prompt number one", "x", "a much longer prompt " * 20, "please say FORBIDDEN words",
             "Привет, как дела у тебя сегодня?", "fine prompt two"]
    src = SourceConfig(name="p", path=_prompts(tmp_path / "p.jsonl", texts))
    cfg = _cfg(tmp_path, sources=[src], min_prompt_chars=2, max_prompt_chars=200, blocklist=["(?i)forbidden"],
               max_non_latin=0.5, max_prompt_tokens=40, eval_fraction=0.0)
    m = curate.run(Store(str(tmp_path)), STAMP, cfg, tokenizer=tiny_target.path)
    assert m.dropped == {"too_short": 1, "too_long": 1, "blocklisted": 1, "non_latin": 1}
    cfg = _cfg(tmp_path, sources=[src], max_prompt_tokens=3, eval_fraction=0.0)
    m = curate.run(Store(str(tmp_path / "t")), STAMP, cfg, tokenizer=tiny_target.path)
    assert m.dropped["too_many_tokens"] >= 3


def test_near_duplicates_are_removed_and_reported(tmp_path):
    base = "explain how a hash table resolves collisions with open addressing and chaining in detail please"
    texts = [base, base.upper() + "!", base + " now", "what is 17 plus 7?", "what is 17 plus 8?"]
    src = SourceConfig(name="p", path=_prompts(tmp_path / "p.jsonl", texts))
    m = curate.run(Store(str(tmp_path)), STAMP, _cfg(tmp_path, sources=[src], near_dup_threshold=0.8,
                                                   eval_fraction=0.0))
    report = m.extra["near_duplicates"]
    assert m.dropped == {"near_duplicate": 2} and report["removed"] == 2
    assert report["examples"][0]["kept"]["preview"] == base and report["examples"][0]["similarity"] >= 0.8
    kept = {r["messages"][0]["content"] for r in _rows(tmp_path, m)}
    assert {"what is 17 plus 7?", "what is 17 plus 8?", base} == kept


def test_near_dup_banding_finds_similar_and_spares_different():
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(5000)]
    docs = [" ".join(rng.choice(words, 60)) for _ in range(200)]
    edited = [d.rsplit(" ", 1)[0] + " changed" for d in docs[:50]]
    sigs = np.stack([np.frombuffer(dedup.signature(t, 3), "<u4") for t in docs + edited])
    mask, anchor, _ = dedup.near_duplicates(sigs, 0.9)
    assert mask[200:].mean() > 0.9 and not mask[:200].any()
    assert (anchor[200:][mask[200:]] == np.arange(50)[mask[200:]]).all()


def test_mixture_counts_weights_and_determinism(tmp_path):
    a = _prompts(tmp_path / "a.jsonl", [f"alpha question {i}" for i in range(40)])
    b = _prompts(tmp_path / "b.jsonl", [f"beta question {i}" for i in range(30)])
    srcs = [SourceConfig(name="a", path=a, count=10), SourceConfig(name="b", path=b, count=50)]
    m = curate.run(Store(str(tmp_path / "1")), STAMP, _cfg(tmp_path, sources=srcs, shard_rows=7))
    assert m.extra["kept_per_source"] == {"a": 10, "b": 30} and m.dropped == {"mixture_cap": 30}
    again = curate.run(Store(str(tmp_path / "2")), STAMP, _cfg(tmp_path, sources=srcs, shard_rows=7))
    assert [s.sha256 for s in m.shards] == [s.sha256 for s in again.shards]  # byte-identical
    weighted = [SourceConfig(name="a", path=a, weight=3), SourceConfig(name="b", path=b, weight=1)]
    m = curate.run(Store(str(tmp_path / "3")), STAMP, _cfg(tmp_path, sources=weighted, total_rows=20))
    assert m.extra["kept_per_source"] == {"a": 15, "b": 5}
    m = curate.run(Store(str(tmp_path / "4")), STAMP, _cfg(tmp_path, sources=weighted))
    assert m.extra["kept_per_source"] == {"a": 40, "b": 13}  # the largest 3:1 mix 40 + 30 rows allow


def test_quota_rounding_and_selection_are_pure():
    cfg = CurateConfig(sources=[SourceConfig(name=n, path="x", weight=1) for n in "abc"], total_rows=10)
    assert mixture.quotas(cfg, {"a": 9, "b": 9, "c": 9}) == {"a": 4, "b": 3, "c": 3}
    order = np.array([5, 3, 9, 1], np.uint64)
    keep = mixture.select(order, np.array([0, 0, 0, 1]), np.ones(4, bool), [2, 0])
    assert keep.tolist() == [True, True, False, False]


def test_parallel_scans_give_the_same_shards(tmp_path):
    for i in range(3):
        _prompts(tmp_path / f"part-{i}.jsonl", [f"question {i}-{j}" for j in range(30)] + ["question 0-0"])
    src = SourceConfig(name="g", path=str(tmp_path / "part-*.jsonl"))
    serial = curate.run(Store(str(tmp_path / "s")), STAMP, _cfg(tmp_path, sources=[src], shard_rows=16))
    parallel = curate.run(Store(str(tmp_path / "p")), STAMP, _cfg(tmp_path, sources=[src], shard_rows=16),
                          workers=2)
    assert serial.extra["parts"] == 3 and serial.dropped == {"duplicate": 3}
    assert [s.sha256 for s in serial.shards] == [s.sha256 for s in parallel.shards]


def test_hf_datasets_streaming_source(tmp_path):
    pytest.importorskip("datasets", reason="the hf extra (pip install 'draftflow[hf]') is not installed")
    folder = tmp_path / "orca"
    folder.mkdir()
    pq.write_table(pa.table({"system_prompt": ["", "Be brief."], "question": ["Q one?", "Q two?"],
                             "response": ["a", "b"]}), folder / "train-00000-of-00001.parquet")
    src = SourceConfig(name="orca", hf=str(folder), hf_split="train")
    m = curate.run(Store(str(tmp_path / "r")), STAMP, _cfg(tmp_path, sources=[src], eval_fraction=0.0))
    assert m.rows_out == 2 and m.extra["sources"]["orca"]["read"] == 2


def test_rows_too_large_huge_numbers_and_deep_nesting_are_counted_rejects(tmp_path):
    """A 20 MB line is rejected without being held whole (peak Python memory stays near the bound); a
    5,000-digit integer and a line nested 100,000 deep are rejects too; the good rows around them curate."""
    import tracemalloc

    from draftflow.data.readers import read_file

    path = tmp_path / "bad.jsonl"
    good = [json.dumps({"prompt": f"a good prompt number {i}"}) for i in range(3)]
    with open(path, "w") as f:
        f.write(good[0] + "\n" + json.dumps({"prompt": "x" * (20 << 20)}) + "\n" + good[1] + "\n")
        f.write('{"prompt": "p", "n": ' + "9" * 5000 + "}\n" + "[" * 100_000 + "]" * 100_000 + "\n" + good[2] + "\n")
    tracemalloc.start()
    rows = list(read_file(str(path), max_row_bytes=1 << 20))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 << 20, f"peak {peak / 2**20:.1f} MiB reading a 20 MiB line with a 1 MiB bound"
    assert [getattr(r, "reason", "row") for r in rows] == ["row", "row_too_large", "row", "number_too_large",
                                                          "too_deeply_nested", "row"]
    src = SourceConfig(name="bad", path=str(path), max_row_bytes=1 << 20)
    m = curate.run(Store(str(tmp_path)), STAMP, _cfg(tmp_path, sources=[src], eval_fraction=0.0))
    assert m.rows_out == 3
    assert m.dropped == {"row_too_large": 1, "number_too_large": 1, "too_deeply_nested": 1}
    rejects = {r["reason"]: r for r in _rows(tmp_path, m, "rejected")}
    assert rejects["row_too_large"]["row"].startswith('{"prompt": "xxx') and "20,971,535 bytes" in \
        rejects["row_too_large"]["detail"]


@pytest.mark.parametrize("chunk", [1, 3, 7, 1 << 20])
def test_bounded_lines_split_like_readlines_and_cut_long_ones(chunk):
    import io

    from draftflow.data.readers import _bounded_lines

    data = b"ab\n\nccc\n" + b"x" * 25 + b"\nlast-no-newline"
    got = list(_bounded_lines(io.BytesIO(data), limit=10, chunk=chunk))
    assert [size for _, size in got] == [len(line) for line in io.BytesIO(data).readlines()]
    assert [line for line, size in got if size <= 10] == [b"ab\n", b"\n", b"ccc\n"]
    assert got[3][0].startswith(b"xxxxxxxxxx") and got[3][1] == 26 and got[4][1] == len(b"last-no-newline")
    assert list(_bounded_lines(io.BytesIO(b"y" * 30), limit=10, chunk=chunk))[0][1] == 30  # over, at the end
