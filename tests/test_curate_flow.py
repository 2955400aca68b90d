"""curate_flow through Prefect: parallel scan tasks, one merge, a per-source table artifact."""

from __future__ import annotations

import json

from draftflow.config import CurateConfig, SourceConfig, load_config
from flows.keys import run_key


def test_curate_flow_scans_parts_as_tasks_and_publishes_source_table(prefect_harness, tmp_path):
    from prefect.artifacts import Artifact

    from flows.stages import curate_flow

    for i in range(3):
        (tmp_path / f"s{i}.jsonl").write_text("".join(json.dumps({"prompt": f"q {i} {j}"}) + "\n" for j in range(20)))
    sources = [SourceConfig(name="glob", path=str(tmp_path / "s*.jsonl")),
               SourceConfig(name="one", path=str(tmp_path / "s0.jsonl"))]
    cfg = load_config(None, [f"root={tmp_path / 'run'}", "name=flowtest"]).model_copy(
        update={"curate": CurateConfig(sources=sources, shard_rows=16)})
    result = curate_flow(cfg)
    m = result.manifest
    assert result.status == "ran" and m.extra["parts"] == 4
    assert m.dropped == {"duplicate": 20} and m.rows_out == 60
    assert curate_flow(cfg).status == "reused"
    table = Artifact.get(f"{run_key(cfg)}-curate-sources")
    assert table is not None and "glob" in str(table.data)
