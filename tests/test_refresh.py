"""Keeping a drafter fresh, as a library: request logs into batches behind a watermark (bad lines counted and
kept, a crash before the watermark reads the same files into the same batch), the refresh history and its lines,
the root's promoted pointer, the per-category gate, and regenerate copying answers an earlier stage gave.
The flow itself (three refreshes through a real server and worker) is in tests/test_server.py; a refresh killed
mid-train in tests/reliability/test_refresh_kill.py."""

from __future__ import annotations

import json

import pytest

from draftflow.config.evaluate import GateConfig
from draftflow.config.refresh import RefreshConfig
from draftflow.data.sources import BadRow
from draftflow.data.traffic import conversation, holdout
from draftflow.errors import ConfigError
from draftflow.evaluation.gate import decide
from draftflow.promotion import marker_path, pointer, promoted_export, record_promotion
from draftflow.refresh import batches, history
from draftflow.store import Store
from tests.traffic_logs import BAD_LINES, requests, write_log


def test_a_logged_request_becomes_a_conversation_with_its_response_and_bad_ones_name_their_reason():
    row = conversation({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                        "response": {"choices": [{"message": {"role": "assistant", "content": "hello"}}]},
                        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]})
    assert [m["role"] for m in row["messages"]] == ["user", "assistant"] and row["tools"]
    beside = conversation({"messages": [{"role": "user", "content": "hi"}],
                           "choices": [{"message": {"role": "assistant", "content": "yo"}}]})
    assert beside["messages"][-1]["content"] == "yo"
    assert conversation({"messages": [{"role": "user", "content": "hi"}]})["messages"] == [
        {"role": "user", "content": "hi"}]  # no response logged: the request alone
    for bad, reason in (({"prompt": "x"}, "missing_messages"), ({"messages": []}, "missing_messages"),
                        ({"messages": [{"role": "system", "content": "s"}]}, "no_user_turn"),
                        ({"messages": [{"role": "user", "content": "  "}]}, "no_user_turn"),
                        ({"messages": [{"role": "robot", "content": "x"}]}, "unknown_role")):
        with pytest.raises(BadRow) as exc:
            conversation(bad)
        assert exc.value.reason == reason


def test_the_holdout_is_a_stable_share_of_the_rows():
    rows = [conversation(r) for r in requests(400, 7)]
    picked = [holdout(r, 0.2) for r in rows]
    assert picked == [holdout(r, 0.2) for r in rows] and 40 < sum(picked) < 120
    assert not any(holdout(r, 0.0) for r in rows)


def test_new_log_files_become_one_batch_and_bad_lines_are_counted_and_kept(tmp_path):
    store, logs = Store(str(tmp_path / "root")), tmp_path / "logs"
    write_log(logs, "a.jsonl", requests(30, 1), bad=True)
    write_log(logs, "b.jsonl", requests(10, 2) + requests(2, 2))  # two requests logged twice
    (logs / "notes.txt").write_text("not a log")
    rcfg = RefreshConfig(traffic=str(logs), holdout=0.25)
    batch, resumed = batches.take_batch(store, rcfg, set())
    assert not resumed and batch.n == 1 and sorted(batch.files) == [str(logs / "a.jsonl"), str(logs / "b.jsonl")]
    assert batch.rejected == {"malformed_json": 1, "no_user_turn": 1, "missing_messages": 1, "duplicate_in_batch": 2}
    assert batch.rows + batch.held_out == 40 and batch.held_out > 0
    kept = (tmp_path / "root/refresh/traffic/batch-0001/rejects.jsonl").read_text().splitlines()
    assert sorted(json.loads(k)["reason"] for k in kept) == ["malformed_json", "missing_messages", "no_user_turn"]
    assert json.loads(kept[0])["row"].rstrip() == BAD_LINES[0]  # the line as it was, to inspect
    sources = batches.sources_for(store, batch, "recent")
    assert [s["name"] for s in sources] == ["traffic", "traffic_recent"] and sources[1]["split"] == "eval"
    # The batch is pending until a refresh finishes it: asked again, it is the same batch, not a new one.
    assert batches.take_batch(store, rcfg, set())[0].n == 1
    assert batches.take_batch(store, rcfg, {1}) == (None, False)  # finished, and no file is new
    write_log(logs, "c.jsonl", requests(5, 3))
    batch2, _ = batches.take_batch(store, rcfg, {1})
    assert batch2.n == 2 and list(batch2.files) == [str(logs / "c.jsonl")]
    assert [b.n for b in batches.watermark(store)] == [1, 2]


def test_a_crash_before_the_watermark_reads_the_same_files_into_the_same_batch(tmp_path, monkeypatch):
    store, logs = Store(str(tmp_path / "root")), tmp_path / "logs"
    write_log(logs, "a.jsonl", requests(30, 1))
    rcfg = RefreshConfig(traffic=str(logs), holdout=0.3)

    def crash(*args):
        raise KeyboardInterrupt  # killed after the batch's files, before the watermark

    monkeypatch.setattr(batches, "_save", crash)
    with pytest.raises(KeyboardInterrupt):
        batches.take_batch(store, rcfg, set())
    recent = tmp_path / "root/refresh/traffic/batch-0001/recent.jsonl"
    first = recent.read_text()
    assert batches.watermark(store) == []  # the file is not seen yet
    monkeypatch.undo()
    batch, _ = batches.take_batch(store, rcfg, set())
    assert batch.n == 1 and recent.read_text() == first and len(batches.watermark(store)) == 1


def test_a_missing_traffic_path_or_none_set_is_one_line(tmp_path):
    store = Store(str(tmp_path / "root"))
    with pytest.raises(ConfigError, match=r"refresh.traffic=.*nowhere does not exist; point it at") as exc:
        batches.take_batch(store, RefreshConfig(traffic=str(tmp_path / "nowhere")), set())
    assert "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match="set refresh.traffic in the config or pass --traffic"):
        batches.take_batch(store, RefreshConfig(), set())


def test_history_lines_and_the_tau_history_document(tmp_path):
    store = Store(str(tmp_path))
    assert history.entries(store) == [] and history.finished(store) == set()
    history.record(store, {"batch": 1, "at": "2026-12-05T04:00:00+00:00", "new_rows": 60, "tau": 1.61,
                           "live_tau": None, "promoted": True, "reason": "first"})
    done = history.record(store, {"batch": 2, "at": "2026-12-06T04:00:00+00:00", "new_rows": 40, "tau": 1.5,
                                  "live_tau": 1.7, "promoted": False, "reason": "category code fell"})
    assert history.finished(store) == {1, 2}
    assert [history.line(e) for e in done] == [
        "refresh 1: 2026-12-05 new_rows 60 tau 1.610 live_tau - promoted yes first",
        "refresh 2: 2026-12-06 new_rows 40 tau 1.500 live_tau 1.700 promoted no category code fell"]
    doc = history.markdown(done)
    assert "1  candidate 1.610" in doc and "2  live      1.700" in doc and "| 2 | 2026-12-06" in doc


def test_the_promoted_pointer_keeps_its_history_and_names_the_current_drafter(tmp_path):
    store = Store(str(tmp_path))
    assert promoted_export(store) is None and pointer(store) is None
    for fp in ("a" * 16, "b" * 16):
        store.write_json(marker_path(store, "train", fp), {"promoted": True})
        record_promotion(store, "train", fp, evaluate=f"e-{fp[0]}", tau=1.5)
    record_promotion(store, "train", "b" * 16, evaluate="e-b", tau=1.5)  # the same verdict again: no new entry
    data = pointer(store)
    assert data["current"]["train"] == "b" * 16 and [h["train"][0] for h in data["history"]] == ["a", "b"]
    assert promoted_export(store)[0] == "b" * 16
    store.fs.rm(marker_path(store, "train", "b" * 16))  # a later gate withdrew it: the newest marker left is the one
    assert promoted_export(store)[0] == "a" * 16


def test_max_category_regression_fails_on_the_category_that_fell_most():
    report = {"tau": 2.0, "categories": {"chat": {"tau": 2.2}, "code": {"tau": 1.6}, "new": {"tau": 1.9}}}
    base = {"tau": 1.9, "label": "live", "categories": {"chat": 2.2, "code": 1.8}}
    gate = GateConfig(max_regression=0.0, max_category_regression=0.05)
    verdict = decide(report, gate, base)
    assert not verdict["passed"] and verdict["checks"][0]["passed"]  # better overall, worse on code
    check = verdict["checks"][1]
    assert check["name"] == "max_category_regression" and check["value"] == pytest.approx(1 - 1.6 / 1.8)
    assert "category code: tau 1.600 is 11.1% below the baseline's 1.800" in check["detail"]
    assert decide(report, GateConfig(max_regression=0.0, max_category_regression=0.2), base)["passed"]
    with pytest.raises(ValueError, match="max_category_regression compares with max_regression's baseline"):
        GateConfig(max_category_regression=0.1)


def test_regenerate_copies_what_an_earlier_stage_answered_and_generates_only_new_rows(tmp_path, tiny_target,
                                                                                      monkeypatch):
    """A refresh's curate adds rows and reshuffles, so every shard is new: the conversations an earlier regenerate
    stage of the root answered with the same target and settings are copied, and only the rest reach the engine."""
    from draftflow.config import SourceConfig
    from draftflow.stages import curate, regenerate
    from draftflow.stages.common import Source, finalize, manifest_digest
    from draftflow.stages.registry import stamp
    from tests.conftest import tiny_config

    generated: list[str] = []
    real = regenerate._generate_batch
    monkeypatch.setattr(regenerate, "_generate_batch", lambda engine, batch, params: (
        generated.extend(d.row["sample_id"] for d, _ in batch), real(engine, batch, params))[1])

    def regenerate_all(cfg):
        store = Store(cfg.root)
        cm = curate.run(store, stamp(cfg, "curate", {}), cfg)
        inputs = {"curate": manifest_digest(cm)}
        handed = stamp(cfg, "regenerate", inputs)
        fp = handed.fingerprint
        results = [regenerate.run_shard(store, fp, cfg, tiny_target, Source("curate", cm.fingerprint), s)
                   for s in cm.data_shards("train")]
        finalize(store, handed, results)
        from draftflow.data.schema import read_rows

        return {r["sample_id"]: r for res in results for r in read_rows(store.stage_path("regenerate", fp,
                                                                                         res.shard.name))}

    first = regenerate_all(tiny_config(tmp_path / "run"))
    assert set(generated) == set(first)
    generated.clear()
    logs = tmp_path / "logs"
    write_log(logs, "new.jsonl", [r for r in requests(6, 9) if "response" not in r])
    cfg = tiny_config(tmp_path / "run", "curate.seed=1", "curate.shard_rows=8")
    cfg.curate.sources.append(SourceConfig(name="traffic", path=str(logs / "new.jsonl"), format="openai"))
    again = regenerate_all(cfg)
    old = set(again) & set(first)
    assert old and all(again[s]["generated"] == first[s]["generated"] for s in old)
    assert len(set(generated)) >= 4 and set(generated) == set(again) - set(first)  # only rows none answered


def test_traffic_and_root_on_s3_make_the_same_batch(tmp_path, s3_env):
    """Request logs under an s3:// prefix and a run root on S3 (a real S3-compatible server): the batch, its files
    and the sources curate reads are s3:// URLs, and the watermark holds the logs' URLs."""
    import s3fs

    from draftflow.config import SourceConfig
    from draftflow.data.readers import source_files

    fs = s3fs.S3FileSystem()
    fs.mkdir("refresh-logs")
    write_log(tmp_path, "day1.jsonl", requests(20, 4), bad=True)
    fs.put(str(tmp_path / "day1.jsonl"), "refresh-logs/chat/day1.jsonl")
    store = Store("s3://refresh-logs/runs/r")
    batch, _ = batches.take_batch(store, RefreshConfig(traffic="s3://refresh-logs/chat", holdout=0.3), set())
    assert list(batch.files) == ["s3://refresh-logs/chat/day1.jsonl"] and batch.new_rows == 20
    assert batch.rejected == {"malformed_json": 1, "no_user_turn": 1, "missing_messages": 1}
    sources = batches.sources_for(store, batch, "recent")
    assert all(s["path"].startswith("s3://refresh-logs/runs/r/refresh/traffic/") for s in sources)
    files = source_files(SourceConfig(**sources[0]))
    assert files == ["s3://refresh-logs/runs/r/refresh/traffic/batch-0001/train.jsonl"]
    assert [b.n for b in batches.watermark(store)] == [1]


def test_a_pointer_naming_a_deleted_export_is_one_line_before_a_refresh(tmp_path):
    """The promoted pointer names a drafter whose export was deleted by hand: the refresh stops before any work in
    one line (a gate's withdrawal, which removes the marker alone, falls back to the newest marker instead)."""
    from draftflow.refresh.preflight import check_refresh
    from tests.conftest import tiny_config

    logs = tmp_path / "logs"
    write_log(logs, "a.jsonl", requests(3, 1))
    cfg = tiny_config(tmp_path / "run", f"refresh.traffic={logs}")
    store = Store(cfg.root)
    check_refresh(cfg)  # nothing promoted yet: a first, cold refresh
    record_promotion(store, "train", "c" * 16, evaluate="e", tau=1.4)  # its export never written (or deleted)
    assert promoted_export(store)[0] == "c" * 16
    with pytest.raises(ConfigError, match=r"train.init_from='promoted': the promoted drafter .*cccc.* is gone") as exc:
        check_refresh(cfg)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("warm", [True, False])
def test_a_warm_candidate_trains_a_share_of_the_steps_at_a_share_of_the_rate(tmp_path, warm):
    """A warm start at the full rate jolted the live drafter (docs/operations.md "Refreshes"); a cold one is as
    configured."""
    from draftflow.config import load_config
    from flows.refresh import candidate_config

    cfg = load_config("configs/tiny.yaml", [f"root={tmp_path}", "train.max_steps=400", "train.lr=0.003"])
    batch = batches.Batch(n=1, files={})
    got = candidate_config(cfg, Store(str(tmp_path)), batch, warm=warm).train
    assert (got.init_from, got.max_steps, got.lr) == (("promoted", 120, pytest.approx(0.0009)) if warm else
                                                      (None, 400, 0.003))
    unscaled = cfg.model_copy(update={"refresh": cfg.refresh.model_copy(update={"warm_steps": None, "warm_lr": None})})
    got = candidate_config(unscaled, Store(str(tmp_path)), batch, warm=warm).train
    assert (got.max_steps, got.lr) == (400, 0.003)
