"""One recompute path for every stage: a committed shard damaged in place (same size, other bytes) is
found, recomputed to the same bytes, and the run goes on; nothing gets stuck on a cached copy of it."""

from __future__ import annotations

import json
from pathlib import Path

from draftflow.store import sha256_file
from tests.conftest import tiny_config

SHARDED = ["regenerate", "tokenize", "extract"]


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_shard_of_each_stage_is_recomputed_in_place(prefect_harness, tmp_path):
    from flows.pipeline import pipeline

    cfg = tiny_config(tmp_path / "run")
    first = pipeline(cfg)
    paths = {s["stage"]: Path(s["path"]) for s in first["stages"]}
    for stage in SHARDED:
        manifest = json.loads((paths[stage] / "manifest.json").read_text())
        shard = paths[stage] / manifest["shards"][0]["name"]
        original = sha256_file(shard)
        _flip_last_byte(shard)
        (paths[stage] / "manifest.json").unlink()  # as after a crash before the manifest: the flow re-runs
        again = pipeline(cfg)
        status = {s["stage"]: s["status"] for s in again["stages"]}
        assert status[stage] == "ran", stage
        assert sha256_file(shard) == original, f"{stage}: the damaged shard was not recomputed"
        assert all(status[s] == "reused" for s in status if s != stage), status  # same bytes: nothing else
        assert again["tau"] == first["tau"]
