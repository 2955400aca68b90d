"""The typed contracts between stages: what is checked where, old manifests read, newer ones refused."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from draftflow.contracts import MANIFEST_VERSION, ManifestError, ShardResult, StageResult
from draftflow.stages.common import finalize, shard_result, write_parquet
from draftflow.store import Store

SHA = "0" * 64


def test_a_shard_result_that_loses_rows_or_has_a_bad_entry_is_refused():
    entry = {"name": "a.parquet", "rows": 2, "tokens": 0, "bytes": 10, "sha256": SHA, "split": "train"}
    ShardResult.model_validate({"shard": entry, "rejected": None, "rows_in": 3, "rows_out": 2, "dropped": {"x": 1}})
    with pytest.raises(ValidationError, match="1 rows unaccounted for"):
        ShardResult.model_validate({"shard": entry, "rejected": None, "rows_in": 3, "rows_out": 2, "dropped": {}})
    with pytest.raises(ValidationError, match="sha256"):
        ShardResult.model_validate({"shard": entry | {"sha256": "nope"}, "rejected": None, "rows_in": 2,
                                    "rows_out": 2, "dropped": {}})


def _written(tmp_path, monkeypatch):
    """A real one-shard stage written through finalize (config sections of the curate stage)."""
    import pyarrow as pa

    from draftflow.config import RunConfig
    from draftflow.stages.registry import stamp

    store = Store(str(tmp_path / "root"))
    entry = write_parquet(store, "curate", "fp1", "part-0.parquet", [{"x": 1}, {"x": 2}],
                          pa.schema([("x", pa.int64())]), split="train")
    result = shard_result(entry, None, rows_in=3, rows_out=2, dropped={"too_short": 1})
    manifest = finalize(store, stamp(RunConfig(), "curate", {"sources": "s"}).model_copy(update={"fingerprint": "fp1"}),
                        [result])
    return store, manifest


def test_finalize_writes_a_versioned_manifest_that_reads_back(tmp_path, monkeypatch):
    store, manifest = _written(tmp_path, monkeypatch)
    assert manifest.version == MANIFEST_VERSION
    assert store.read_manifest("curate", "fp1") == manifest
    on_disk = store.read_json(store.stage_path("curate", "fp1", "manifest.json"))
    assert on_disk == manifest.to_json() and on_disk["shards"][0]["split"] == "train"
    assert "kind" not in on_disk["shards"][0]  # unset optional fields stay out of the JSON
    StageResult(stage="curate", fingerprint="fp1", status="reused", digest="d", path="p", manifest=manifest)
    with pytest.raises(ValidationError, match="frozen"):
        manifest.rows_out = 5  # a contract is a value: nothing downstream can change what a stage wrote


def test_a_manifest_from_before_versions_is_read(tmp_path, monkeypatch):
    store, manifest = _written(tmp_path, monkeypatch)
    path = store.stage_path("curate", "fp1", "manifest.json")
    old = {k: v for k, v in manifest.to_json().items() if k != "version"}
    store.write_json(path, old)
    read = store.read_manifest("curate", "fp1")
    assert read.version == 1 and read.shards == manifest.shards and read.rows_out == manifest.rows_out


def test_a_manifest_from_a_newer_draftflow_is_refused_in_one_line(tmp_path, monkeypatch):
    store, manifest = _written(tmp_path, monkeypatch)
    path = store.stage_path("curate", "fp1", "manifest.json")
    store.write_json(path, manifest.to_json() | {"version": MANIFEST_VERSION + 1})
    with pytest.raises(ManifestError, match="written by a newer draftflow") as err:
        store.read_manifest("curate", "fp1")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("damage", ["torn", "foreign", "lost rows"])
def test_a_damaged_manifest_means_the_stage_is_recomputed(tmp_path, monkeypatch, damage):
    store, manifest = _written(tmp_path, monkeypatch)
    path = store.stage_path("curate", "fp1", "manifest.json")
    text = json.dumps(manifest.to_json())
    with open(path, "w") as fh:
        fh.write({"torn": text[: len(text) // 2], "foreign": json.dumps({"hello": 1}),
                  "lost rows": json.dumps(manifest.to_json() | {"rows_out": 1})}[damage])
    assert store.read_manifest("curate", "fp1") is None


def test_feature_sources_round_trip_through_json_as_a_rank_receives_them():
    from draftflow.contracts import CarriedFile, OnlineFeatures, StoredFeatures, read_feature_source

    entry = {"name": "a.safetensors", "rows": 2, "bytes": 10, "sha256": SHA, "split": "train", "layer_ids": [1, 3]}
    counts = CarriedFile(stage="tokenize", fingerprint="tok", entry={"name": "token_freq.parquet", "rows": 5,
                                                                      "bytes": 9, "sha256": SHA, "kind": "freq"})
    stored = StoredFeatures(stage="extract", fingerprint="ex", shards=(entry,), token_counts=counts)
    online = OnlineFeatures(stage="filter", fingerprint="fi", shards=({k: entry[k] for k in ("name", "rows", "bytes",
                                                                                              "sha256")},))
    for source in (stored, online):
        assert read_feature_source(json.loads(json.dumps(source.model_dump(mode="json")))) == source
    assert stored.shards[0].layer_ids == (1, 3) and stored.token_counts.entry.kind == "freq"
    with pytest.raises(ValidationError):
        read_feature_source({"mode": "somewhere", "shards": []})


def test_side_files_are_handed_on_by_a_stage_in_between_unless_it_replaces_them(tmp_path, monkeypatch):
    """tokenize's token counts reach train through a stage put after tokenize (and through extract)."""
    from draftflow.contracts import CARRIED, CarriedFile, carried, carry

    _, manifest = _written(tmp_path, monkeypatch)
    counts = CarriedFile(stage="tokenize", fingerprint="tok", entry={"name": "token_freq.parquet", "rows": 5,
                                                                      "bytes": 9, "sha256": SHA, "kind": "freq"})
    tokenized = manifest.model_copy(update={"extra": {CARRIED: {"token_counts": counts.model_dump(mode="json")}}})
    filtered = manifest.model_copy(update={"extra": carry(tokenized, {"kept": 3})})
    assert carried(filtered) == {"token_counts": counts} and filtered.extra["kept"] == 3
    own = CarriedFile(stage="filter", fingerprint="fi", entry=counts.entry)
    replaced = carry(filtered, {CARRIED: {"token_counts": own.model_dump(mode="json")}})
    assert carried(manifest.model_copy(update={"extra": replaced})) == {"token_counts": own}
    assert carry(manifest, {"a": 1}) == {"a": 1}  # nothing to hand on: the extra as it was
