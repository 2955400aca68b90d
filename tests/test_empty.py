"""Empty is a value: a shard with no rows flows on, and a stage that keeps nothing stops the run in one
line naming it and its top drop reasons (it used to crash extract with an IndexError, retried 3x)."""

from __future__ import annotations

import pytest

from draftflow.contracts import Manifest
from draftflow.stages import extract
from draftflow.stages.common import EmptyStage, Source, require_rows, write_parquet
from draftflow.store import Store
from tests.conftest import tiny_config


def test_an_empty_tokenize_shard_gives_an_empty_extract_result(tmp_path, tiny_target):
    from draftflow.data.schema import TOKENIZED

    cfg = tiny_config(tmp_path / "run")
    store = Store(cfg.root)
    entry = write_parquet(store, "tokenize", "tokfp", "train-00000.parquet", [], TOKENIZED, split="train")
    result = extract.run_shard(store, "exfp", cfg, tiny_target, Source("tokenize", "tokfp"), entry)
    assert (result.shard, result.rows_in, result.rows_out) == (None, 0, 0)


def test_a_stage_that_kept_nothing_is_one_line_with_its_reasons():
    manifest = Manifest(stage="tokenize", fingerprint="fp", code_version="c", config={}, inputs={}, shards=(),
                        rows_in=48, rows_out=0, dropped={"too_few_supervised_tokens": 47, "prompt_too_long": 1},
                        tokens=0)
    with pytest.raises(EmptyStage, match=r"tokenize kept no rows of 48 \(dropped too_few_supervised_tokens=47, "
                                         r"prompt_too_long=1\)") as err:
        require_rows(manifest)
    assert "\n" not in str(err.value)
    require_rows(manifest.model_copy(update={"rows_out": 1}))  # anything kept: the run goes on


def test_the_pipeline_stops_at_the_stage_that_kept_nothing(prefect_harness, tmp_path):
    from flows.pipeline import pipeline

    cfg = tiny_config(tmp_path / "run", "tokenize.min_supervised_tokens=100000")
    with pytest.raises(EmptyStage, match="tokenize kept no rows .*too_few_supervised_tokens"):
        pipeline(cfg)
    assert not (tmp_path / "run" / "extract").exists()  # nothing after it ran
