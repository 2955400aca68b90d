"""The store on s3:// against a real S3-compatible server (moto) on 127.0.0.1."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def s3_root(s3_env):
    import s3fs

    s3fs.S3FileSystem().mkdir("draftflow-test")
    return "s3://draftflow-test/runs/one"


def test_atomic_write_manifest_and_checksum_on_s3(s3_root):
    from draftflow.contracts import Manifest
    from draftflow.store import Store, shard_entry

    store = Store(s3_root)
    assert not store.is_local
    with pytest.raises(RuntimeError):
        with store.writing(store.stage_path("s", "fp", "x.bin")) as tmp:
            open(tmp, "wb").write(b"half")
            raise RuntimeError("crash")
    assert not store.exists(store.stage_path("s", "fp", "x.bin"))  # nothing half-written
    with store.writing(store.stage_path("s", "fp", "x.bin")) as tmp:
        open(tmp, "wb").write(b"payload")
        entry = shard_entry("x.bin", tmp, rows=1)
    manifest = Manifest(stage="s", fingerprint="fp", code_version="c", config={}, inputs={}, shards=(entry,),
                        rows_in=1, rows_out=1, dropped={}, tokens=0)
    store.write_manifest("s", "fp", manifest)
    assert store.read_manifest("s", "fp").shards[0].sha256 == entry.sha256
    assert open(store.verify_sha("s", "fp", entry), "rb").read() == b"payload"
    assert store.url(store.stage_path("s", "fp")).startswith("s3://draftflow-test/runs/one/s/fp")


def test_curate_stage_writes_its_shards_to_s3(s3_root):
    from draftflow.config import load_config
    from draftflow.stages import curate
    from draftflow.stages.registry import stamp
    from draftflow.store import Store

    cfg = load_config("configs/tiny.yaml", [f"root={s3_root}/curate-run"])
    store = Store(cfg.root)
    handed = stamp(cfg, "curate", {})
    fp = handed.fingerprint
    manifest = curate.run(store, handed, cfg)
    assert store.read_manifest("curate", fp) == manifest
    assert manifest.rows_in == manifest.rows_out + sum(manifest.dropped.values())
