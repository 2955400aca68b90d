"""The regenerate stage through the OpenAI-compatible engine against a real local server."""

import pytest

from draftflow.data.schema import read_rows
from draftflow.engines.hf import HFEngine
from draftflow.errors import DraftflowError
from draftflow.stages import curate, regenerate, tokenize
from draftflow.stages.common import Source
from draftflow.stages.registry import stamp
from draftflow.store import Store
from tests.conftest import tiny_config
from tests.openai_server import OpenAITestServer


@pytest.fixture(scope="module")
def server(tiny_target):
    srv = OpenAITestServer(HFEngine.load(tiny_target.path))
    srv.start()
    yield srv
    srv.stop()


def test_http_regeneration_feeds_tokenize_through_the_template(tmp_path, tiny_target, server):
    cfg = tiny_config(tmp_path / "run", "regenerate.engine=openai", f"regenerate.openai.endpoints=['{server.url}']",
                      "regenerate.openai.model=tiny", "regenerate.checkpoint_every=8")
    store = Store(cfg.root)
    cm = curate.run(store, stamp(cfg, "curate", {}), cfg)
    shard = [s for s in cm.shards if s.split == "train"][0]
    regenerate.check_engine(cfg, tiny_target)  # reachable: no error
    res = regenerate.run_shard(store, "http", cfg, tiny_target, Source("curate", cm.fingerprint), shard)
    assert res.rows_in == res.rows_out + sum(res.dropped.values()) == shard.rows
    rows = read_rows(store.stage_path("regenerate", "http", shard.name))
    assert rows and all(g["ids"] == [] for r in rows for g in r["generated"])  # text-only engine
    assert '"engine": "openai"' in rows[0]["provenance"]
    # Tokenize derives each turn's ids from the template when the engine gave text only.
    tok = tokenize.run_shard(store, "tok", cfg, tiny_target, Source("regenerate", "http"), res.shard)
    assert tok.rows_out + sum(tok.dropped.values()) == tok.rows_in and tok.rows_out > 0


def test_unreachable_endpoint_fails_at_stage_start_naming_the_url(tmp_path, tiny_target):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    cfg = tiny_config(tmp_path / "run", "regenerate.engine=openai", f"regenerate.openai.endpoints=['{dead}']")
    with pytest.raises(DraftflowError, match=dead.replace(".", r"\.")):
        regenerate.check_engine(cfg, tiny_target)


def test_fixed_data_keeps_the_sources_answers_and_generates_nothing(tmp_path, tiny_target):
    """`regenerate.answers: source` (EAGLE-1's fixed data): no engine; every row with an answer keeps it, and
    tokenize supervises it through the template; prompt-only rows are counted rejects."""
    from tests.conftest import run_front

    cfg = tiny_config(tmp_path / "run", "regenerate.answers=source", "regenerate.engine=openai")  # never started
    store, shard, rfp, res, tok = run_front(cfg, tiny_target)
    assert res.rows_in == res.rows_out + sum(res.dropped.values()) == shard.rows
    assert res.rows_out > 0 and set(res.dropped) <= {"no_source_answer"}
    curated_at = stamp(cfg, "curate", {}).fingerprint
    curated = {r["sample_id"]: r for r in read_rows(store.verify_sha("curate", curated_at, shard))}
    rows = read_rows(store.stage_path("regenerate", rfp, shard.name))
    assert all(r["messages"] == curated[r["sample_id"]]["messages"] for r in rows)  # the source's own answers
    assert all(g["ids"] == [] and g["finish_reason"] == "source" for r in rows for g in r["generated"])
    assert tok.rows_out > 0 and tok.rows_out + sum(tok.dropped.values()) == tok.rows_in
    from draftflow.chat import ChatFormat

    prompt_only = dict(rows[0], messages=[m for m in rows[0]["messages"] if m["role"] != "assistant"])
    out, rejects = regenerate.keep_source_answers([prompt_only], ChatFormat.from_pretrained(tiny_target.path))
    assert out == [] and rejects[0]["reason"] == "no_source_answer"
