import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from draftflow.config import CurateConfig, SourceConfig, load_config
from draftflow.data.schema import read_rows
from draftflow.errors import SourceError
from draftflow.stages import curate
from draftflow.stages.registry import stamp
from draftflow.store import Store
from tests.conftest import stamped


def _write_sources(tmp_path):
    sg = tmp_path / "sg.jsonl"
    sg.write_text("\n".join(json.dumps(r) for r in [
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi there"},
                           {"from": "gpt", "value": "Hello!"}]},
        {"conversations": [{"from": "human", "value": "Hi   there"}, {"from": "gpt", "value": "Other answer"}]},
        {"conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "dup"}]},
        {"conversations": [{"from": "gpt", "value": "no question"}]},
        {"conversations": [{"from": "robot", "value": "?"}]},
        {"conversations": [{"from": "human", "value": ["not", "text"]}]},
        {"conversations": [{"from": "human", "value": "   "}]},
    ]) + "\n{broken\n")
    oa = tmp_path / "oa.jsonl"
    oa.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"Question {i}"},
                                                     {"role": "assistant", "content": f"Answer {i}"}]})
                            for i in range(10)) + "\n")
    al = tmp_path / "al.parquet"
    pq.write_table(pa.table({"instruction": ["Add 2 and 3.", "Name a color."], "input": ["", "One word."],
                             "output": ["5", "Red"]}), al)
    return CurateConfig(sources=[SourceConfig(name="sg", path=str(sg)), SourceConfig(name="oa", path=str(oa)),
                                 SourceConfig(name="al", path=str(al), format="alpaca")],
                        eval_fraction=0.2, shard_rows=4)


def _run(ccfg, root):
    cfg = load_config(None, [f"root={root}"]).model_copy(update={"curate": ccfg})
    return curate.run(Store(str(root)), stamped("curate", "fp", {}), cfg)


def _rows(root, manifest, kind="shards"):
    return [r for s in getattr(manifest, kind) for r in read_rows(f"{root}/curate/fp/{s.name}")]


def test_adapters_rejects_and_dedup_account_for_every_row(tmp_path):
    ccfg = _write_sources(tmp_path)
    m = _run(ccfg, tmp_path / "a")
    assert m.rows_in == 8 + 10 + 2
    # Row 1 has a system prompt (part of the key); rows 2 and 3 differ only in whitespace,
    # so row 3 is the one duplicate.
    dropped = m.dropped
    assert dropped == {"duplicate": 1, "no_user_turn": 1, "unknown_role": 1, "non_text_content": 1,
                       "empty_prompt": 1, "malformed_json": 1}
    assert m.rows_out + sum(dropped.values()) == m.rows_in
    rejects = _rows(tmp_path / "a", m, "rejected")
    assert sorted(r["reason"] for r in rejects) == sorted(k for k in dropped if k != "duplicate")
    kept = _rows(tmp_path / "a", m)
    alpaca = {r["messages"][0]["content"] for r in kept if r["source"] == "al"}
    assert "Name a color.\n\nOne word." in alpaca
    first = next(r for r in kept if r["messages"][0]["role"] == "system")
    assert first["messages"][0] == {"role": "system", "content": "Be brief.", "reasoning_content": None}
    assert m.extra["sources"]["sg"]["read"] == 8 and m.extra["sources"]["sg"]["dropped"]["duplicate"] == 1
    assert not (tmp_path / "a" / "curate" / "fp" / "parts").exists()  # partials removed after the manifest


def test_run_is_deterministic_split_and_sharded(tmp_path):
    ccfg = _write_sources(tmp_path)
    cfg = load_config(None, [f"root={tmp_path / 'a'}"]).model_copy(update={"curate": ccfg})
    m1 = curate.run(Store(str(tmp_path / "a")), stamped("curate", "fp", {}), cfg)
    m2 = curate.run(Store(str(tmp_path / "b")), stamped("curate", "fp", {}), cfg)
    assert [s.sha256 for s in m1.shards] == [s.sha256 for s in m2.shards]  # byte-identical
    splits = {s.split for s in m1.shards}
    assert splits == {"train", "eval"}
    assert all(s.rows <= 4 for s in m1.shards)
    assert m1.rows_in == m1.rows_out + sum(m1.dropped.values())
    ids = [r["sample_id"] for s in m1.shards for r in read_rows(f"{tmp_path}/a/curate/fp/{s.name}")]
    assert len(ids) == len(set(ids)) == m1.rows_out
    rejected = read_rows(f"{tmp_path}/a/curate/fp/{m1.rejected[0].name}")
    assert {r["reason"] for r in rejected} >= {"no_user_turn", "malformed_json"}


def test_sample_ids_are_stable_and_carried(tmp_path):
    ccfg = _write_sources(tmp_path)
    a = _rows(tmp_path / "a", _run(ccfg, tmp_path / "a"))
    b = _rows(tmp_path / "b", _run(ccfg.model_copy(update={"seed": 5}), tmp_path / "b"))
    assert sorted(r["sample_id"] for r in a) == sorted(r["sample_id"] for r in b)  # ids do not depend on the seed
    assert [r["sample_id"] for r in a] != [r["sample_id"] for r in b]  # the order does


def test_missing_source_fails_at_start_with_its_path(tmp_path):
    cfg = load_config("configs/tiny.yaml", [f"root={tmp_path}/r"])
    cfg.curate.sources[1].path = str(tmp_path / "missing.jsonl")
    with pytest.raises(SourceError, match=r"source 'openai': path .*missing.jsonl does not exist"):
        curate.run(Store(cfg.root), stamp(cfg, "curate", {}), cfg)
    assert not (tmp_path / "r").exists()  # nothing written
