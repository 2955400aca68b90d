"""The regenerate stage through the OpenAI-compatible engine against a real local server."""

import pytest

from draftflow.data.schema import read_rows
from draftflow.engines.hf import HFEngine
from draftflow.errors import DraftflowError
from draftflow.stages import curate, regenerate, tokenize
from draftflow.stages.common import Source, fingerprint
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
    cm = curate.run(store, fingerprint("curate", cfg, {}), cfg, {})
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
