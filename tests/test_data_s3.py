"""Curation reading sources from and writing shards to S3 (moto's server on 127.0.0.1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import stamped

FIX = Path(__file__).parent / "fixtures" / "sources"


@pytest.fixture(scope="module")
def bucket(s3_env):
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.mkdir("curate-test")
    for name in ("sharegpt.jsonl", "magicoder.jsonl.gz", "prompts.jsonl.zst", "openorca.parquet"):
        fs.put_file(str(FIX / name), f"curate-test/src/{name}")
    return "s3://curate-test"


def test_curate_reads_s3_sources_and_writes_s3_shards(bucket):
    from draftflow.config import CurateConfig, SourceConfig, load_config
    from draftflow.data.schema import read_rows
    from draftflow.stages import curate
    from draftflow.store import Store

    sources = [SourceConfig(name="jsonl", path=f"{bucket}/src/*.jsonl*"),
               SourceConfig(name="orca", path=f"{bucket}/src/openorca.parquet")]
    cfg = load_config(None, [f"root={bucket}/runs/one"]).model_copy(
        update={"curate": CurateConfig(sources=sources, shard_rows=4)})
    inputs, _ = curate.stage_inputs(cfg)
    store = Store(cfg.root)
    manifest = curate.run(store, stamped("curate", "fp", inputs), cfg)
    assert store.read_manifest("curate", "fp") == manifest
    assert manifest.extra["parts"] == 4 and manifest.extra["sources"]["jsonl"]["read"] == 9
    assert manifest.rows_in == manifest.rows_out + sum(manifest.dropped.values())
    rows = [r for s in manifest.shards for r in read_rows(store.verify_sha("curate", "fp", s))]
    assert len(rows) == manifest.rows_out and store.exists(store.stage_path("curate", "fp", "prompt_lengths.png"))


def test_unreachable_s3_source_fails_at_start_naming_it(bucket):
    from draftflow.config import CurateConfig, SourceConfig, load_config
    from draftflow.errors import SourceError
    from draftflow.stages import curate

    cfg = load_config(None, [f"root={bucket}/runs/two"]).model_copy(update={"curate": CurateConfig(
        sources=[SourceConfig(name="gone", path=f"{bucket}/src/missing-*.jsonl")])})
    with pytest.raises(SourceError, match=r"source 'gone': path s3://curate-test/src/missing-\*.jsonl does not exist"):
        curate.stage_inputs(cfg)
