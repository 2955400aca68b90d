"""A stage put after tokenize: train and `plan` find what they need through what each stage is handed.

`few_supervised` sits between tokenize and extract and drops sequences with fewer than MIN_SUPERVISED tokens
under the loss mask. It replaces the sequences but not tokenize's token counts, which reach train through it
(`contracts.carry`): EAGLE-3's draft vocabulary and DFlash's sampled softmax read them there, online features
read its sequences, and `plan` and `status` size the stages after it from its manifest (they said 'KeyError:
train_tokens' and stopped EAGLE-3 with "needs the tokenize stage's token_freq.parquet" before).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from draftflow.contracts import ShardEntry, ShardResult
from draftflow.data.schema import TOKENIZED, read_rows
from draftflow.stages.common import Source, reject, shard_result, write_parquet, write_rejects
from draftflow.stages.registry import REGISTRY, StageSpec, stage_names, using
from draftflow.store import Store
from draftflow.target import TargetRef
from tests.conftest import tiny_config

MIN_SUPERVISED = 24  # the tiny run answers 24 tokens at most: drops the few that ended sooner
STAGE = "few_supervised"


def few_supervised_shard(store: Store, fp: str, cfg, target: TargetRef, source: Source,
                         shard: ShardEntry) -> ShardResult:
    """Keep the sequences with at least MIN_SUPERVISED supervised tokens."""
    rows = read_rows(store.verify_sha(*source, shard))
    keep = [r for r in rows if sum(r["loss_mask"]) >= MIN_SUPERVISED]
    rejects = [reject(STAGE, "few_supervised_tokens", f"< {MIN_SUPERVISED}", r["sample_id"])
               for r in rows if sum(r["loss_mask"]) < MIN_SUPERVISED]
    entry = write_parquet(store, STAGE, fp, shard.name, keep, TOKENIZED, tokens=sum(len(r["input_ids"]) for r in keep),
                          split=shard.split, sequences=len(keep),
                          supervised_tokens=sum(sum(r["loss_mask"]) for r in keep))
    rejected = write_rejects(store, STAGE, fp, shard.name, rejects)
    return shard_result(entry, rejected, len(rows), len(keep), Counter(r["reason"] for r in rejects))


FEW_SUPERVISED = StageSpec(STAGE, about="Drop sequences with few supervised tokens (CPU).", sections=(),
                           run_shard=few_supervised_shard, unit="sequences")


@pytest.mark.parametrize("overrides", [
    ["drafter.kind=eagle3", "train.max_steps=6"],  # its draft vocabulary: the token counts
    ["train.sampled_softmax=64", "train.max_steps=6"],  # the sampled softmax's candidates: the token counts
    ["extract.mode=online", "train.max_steps=6"],  # features computed in training from the filtered sequences
], ids=["eagle3", "sampled_softmax", "online"])
def test_a_stage_after_tokenize_is_read_by_extract_train_plan_and_status(prefect_harness, tmp_path, tiny_target,
                                                                        overrides):
    from draftflow.runs.plan import plan
    from draftflow.runs.runinfo import stage_status
    from flows.pipeline import pipeline

    cfg = tiny_config(tmp_path / "run", *overrides)
    target = TargetRef(tiny_target.path, tiny_target.fingerprint)
    with using(REGISTRY.with_stage(FEW_SUPERVISED, before="extract")):
        names = stage_names()  # right before extract, after tokenize (and any stage a copy has put in between)
        assert names[names.index(STAGE) + 1] == "extract" and "tokenize" in names[:names.index(STAGE)]
        summary = pipeline(cfg)
        stages = {s["stage"]: s for s in summary["stages"]}
        assert all(s["status"] == "ran" for s in summary["stages"]), summary["stages"]
        ours = stages[STAGE]
        assert ours["dropped"] and ours["rows_out"] > 0  # it dropped some sequences, kept others
        assert stages["extract"]["rows_in"] == ours["rows_out"]  # extract read the filtered sequences
        extract = json.loads((Path(stages["extract"]["path"]) / "manifest.json").read_text())
        assert extract["extra"]["carried"]["token_counts"]["stage"] == "tokenize"  # handed on through ours
        if "extract.mode=online" in overrides:
            assert extract["extra"]["sequences"]["stage"] == STAGE
        assert stages["train"]["status"] == "ran" and summary["tau"] >= 1.0

        planned = {s["stage"]: s for s in plan(cfg, target)}  # every stage complete: sized from its manifest
        status = {s["stage"]: s for s in stage_status(cfg, target)}
        assert all(s["state"] == "complete" for s in status.values())
        for name in ("tokenize", STAGE, "extract", "train"):  # plan and status agree
            assert planned[name]["tokens"] == status[name]["tokens"], name
        assert status["train"]["tokens"] > 0
