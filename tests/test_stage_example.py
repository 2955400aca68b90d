"""docs/extending.md's worked stage, put in for the test: a new stage is one shard function plus one registry entry.

`short_answers` sits between regenerate and tokenize and drops conversations whose regenerated
answers are nearly empty. It names no other stage: it reads its input through the `Source` it is
given, writes the same row format, and tokenize reads its output without knowing it is there. The
pipeline runs it, `plan` and `status` show it, and it is fingerprinted like any stage. Where the stage was
added for good (tests/test_worked_examples.py applies the document's steps to a copy and runs this suite
there), it runs as the registry has it instead of being put in.
"""

from __future__ import annotations

import json
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import pytest

from draftflow.contracts import ShardEntry, ShardResult
from draftflow.data.schema import REGENERATED, read_rows
from draftflow.stages.common import Source, reject, shard_result, write_parquet, write_rejects
from draftflow.stages.registry import REGISTRY, StageSpec, stage_names, using
from draftflow.store import Store
from draftflow.target import TargetRef
from tests.conftest import tiny_config

MIN_ANSWER_TOKENS = 3


def short_answers_shard(store: Store, fp: str, cfg, target: TargetRef, source: Source,
                        shard: ShardEntry) -> ShardResult:
    """Keep the conversations whose every regenerated answer has at least MIN_ANSWER_TOKENS tokens."""
    rows = read_rows(store.verify_sha(*source, shard))
    keep, rejects = [], []
    for r in rows:
        if all(g["completion_tokens"] >= MIN_ANSWER_TOKENS for g in r["generated"]):
            keep.append(r)
        else:
            rejects.append(reject(r["source"], "short_answer", f"< {MIN_ANSWER_TOKENS} tokens", r["sample_id"]))
    tokens = sum(g["completion_tokens"] for r in keep for g in r["generated"])
    entry = write_parquet(store, "short_answers", fp, shard.name, keep, REGENERATED, tokens=tokens, split=shard.split)
    rejected = write_rejects(store, "short_answers", fp, shard.name, rejects)
    return shard_result(entry, rejected, len(rows), len(keep), Counter(r["reason"] for r in rejects))


SHORT_ANSWERS = StageSpec("short_answers", about="Drop conversations with near-empty answers (CPU).", sections=(),
                          run_shard=short_answers_shard, unit="conversations")


def _short_answers_in():
    """Put the stage in for a block, unless the registry has it for good."""
    return nullcontext() if "short_answers" in stage_names() else using(REGISTRY.with_stage(SHORT_ANSWERS,
                                                                                               before="tokenize"))


def test_a_stage_added_through_the_registry_runs_is_planned_and_fingerprinted(prefect_harness, tmp_path,
                                                                              tiny_target):
    from draftflow.runs.plan import plan
    from draftflow.runs.runinfo import stage_status
    from flows.pipeline import pipeline

    cfg = tiny_config(tmp_path / "run")
    target = TargetRef(tiny_target.path, tiny_target.fingerprint)
    had = "short_answers" in stage_names()
    with _short_answers_in():
        assert stage_names()[1:4] == ("regenerate", "short_answers", "tokenize")
        before = {s["stage"]: s["state"] for s in plan(cfg, target)}
        assert before["short_answers"] == "waits"  # its input is not there yet

        summary = pipeline(cfg)
        stages = {s["stage"]: s for s in summary["stages"]}
        assert [s["stage"] for s in summary["stages"]][:4] == ["curate", "regenerate", "short_answers", "tokenize"]
        ours = stages["short_answers"]
        assert ours["status"] == "ran" and ours["rows_in"] == stages["regenerate"]["rows_out"]
        assert ours["rows_in"] == ours["rows_out"] + sum(ours["dropped"].values())
        manifest = json.loads((Path(ours["path"]) / "manifest.json").read_text())
        assert manifest["config"] == {}  # sections=(): its code and its input are its fingerprint
        assert set(manifest["inputs"]) == {"target", "regenerate"}
        tok = json.loads((Path(stages["tokenize"]["path"]) / "manifest.json").read_text())
        assert set(tok["inputs"]) == {"target", "libraries", "min_supervised_tokens", "short_answers"}  # read it
        assert stages["tokenize"]["rows_in"] == ours["rows_out"]

        status = {s["stage"]: s for s in stage_status(cfg, target)}
        assert status["short_answers"]["state"] == "complete"
        assert status["short_answers"]["fingerprint"] == ours["fingerprint"]
        assert all(s["state"] == "complete" for s in status.values())

        again = pipeline(cfg)  # everything reused, the new stage included
        assert {s["stage"]: s["status"] for s in again["stages"]}["short_answers"] == "reused"
    assert ("short_answers" in stage_names()) == had


def test_a_stage_cannot_be_put_before_one_that_reads_two():
    from draftflow.errors import ConfigError

    with pytest.raises(ConfigError, match="evaluate does not read exactly one stage"):
        REGISTRY.with_stage(SHORT_ANSWERS, before="evaluate")
