"""Regeneration with the real vLLM engine: the same greedy ids as transformers, and a kill-and-resume."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from draftflow.chat import ChatFormat
from draftflow.data.schema import read_rows
from draftflow.engines import GenRequest, SamplingParams, make_engine
from draftflow.engines.hf import HFEngine
from draftflow.stages import curate, regenerate
from draftflow.stages.common import Source
from draftflow.stages.registry import stamp
from draftflow.store import Store
from tests.conftest import CONVERSATIONS, tiny_config
from tests.reliability.killable import kill_when_frozen
from tests.vllm.conftest import VLLM_OVERRIDES

ROOT = Path(__file__).resolve().parents[2]
PARAMS = SamplingParams(max_new_tokens=12)
KILLED = """
import sys, json
from draftflow.config import RunConfig
from draftflow.contracts import ShardEntry
from draftflow.stages import regenerate
from draftflow.stages.common import Source
from draftflow.store import Store
from draftflow.target import TargetRef

if __name__ == "__main__":  # vLLM starts its engine with spawn
    sys.path.insert(0, sys.argv[4])  # the repository, for tests.reliability.killable
    from tests.reliability.killable import arm_call
    arm_call("draftflow.stages.regenerate", "save_partial", 2, sys.argv[3])  # the first chunk is on disk
    cfg = RunConfig.model_validate_json(open(sys.argv[1]).read())
    args = json.load(open(sys.argv[2]))
    regenerate.run_shard(Store(cfg.root), "killed", cfg, TargetRef(**args["target"]),
                         Source("curate", args["curate_fp"]), ShardEntry.model_validate(args["shard"]))
"""


@pytest.fixture(scope="module")
def vcfg(tmp_path_factory):
    return tiny_config(tmp_path_factory.mktemp("vllm") / "run", "regenerate.engine=vllm",
                       "regenerate.checkpoint_every=4", *VLLM_OVERRIDES)


@pytest.fixture(scope="module")
def vllm_engine(vcfg, tiny_target):
    """The process's shared vLLM engine, as the regenerate stage gets it (one start for the module)."""
    return make_engine(vcfg.regenerate, tiny_target.path, vcfg.target.dtype, vcfg.target.device)


@pytest.fixture(scope="module")
def hf_engine(tiny_target):
    return HFEngine.load(tiny_target.path, dtype="float32", device="cpu")


def test_greedy_ids_equal_transformers_for_every_kind_of_conversation(vllm_engine, hf_engine):
    chat = ChatFormat(hf_engine.tokenizer)
    requests = [GenRequest(m, kw, chat.prompt_ids(m, **kw)) for m, kw in CONVERSATIONS]
    assert len({tuple(r.prompt_ids) for r in requests}) == len(requests)
    got, want = vllm_engine.generate(requests, PARAMS), hf_engine.generate(requests, PARAMS)
    assert [c.ids for c in got] == [c.ids for c in want]
    assert [(c.text, c.finish_reason, c.prompt_tokens) for c in got] == \
        [(c.text, c.finish_reason, c.prompt_tokens) for c in want]
    assert vllm_engine.name == "vllm" and all(c.ids for c in got)


def test_the_stage_shares_one_engine_per_process(vcfg, tiny_target, vllm_engine):
    again = make_engine(vcfg.regenerate, tiny_target.path, vcfg.target.dtype, vcfg.target.device)
    assert again is vllm_engine


def _ids(rows):
    return [(r["sample_id"], [g["ids"] for g in r["generated"]]) for r in rows]


def test_sigkill_mid_shard_resumes_to_the_transformers_result(tmp_path, vcfg, tiny_target, vllm_engine):
    store = Store(vcfg.root)
    cm = curate.run(store, stamp(vcfg, "curate", {}), vcfg)
    shard = [s for s in cm.shards if s.split == "train"][0]
    (tmp_path / "cfg.json").write_text(vcfg.model_dump_json())
    (tmp_path / "args.json").write_text(json.dumps({
        "target": {"path": tiny_target.path, "fingerprint": tiny_target.fingerprint},
        "curate_fp": cm.fingerprint, "shard": shard.to_json()}))
    (tmp_path / "killed.py").write_text(KILLED)
    marker = tmp_path / "frozen"
    proc = subprocess.Popen([sys.executable, str(tmp_path / "killed.py"), str(tmp_path / "cfg.json"),
                             str(tmp_path / "args.json"), str(marker), str(ROOT)], cwd=ROOT, start_new_session=True)
    partial = Path(store.stage_path("regenerate", "killed", "partial", shard.name))
    # Frozen before its second checkpoint; the whole group dies: vLLM's engine-core and worker processes too.
    kill_when_frozen(proc, marker, timeout=900, group=True)
    assert proc.returncode == -signal.SIGKILL
    done_before = len(read_rows(str(partial)))
    assert 0 < done_before < shard.rows  # killed mid-shard, after a checkpoint
    assert not Path(store.stage_path("regenerate", "killed", shard.name)).exists()

    resumed = regenerate.run_shard(store, "killed", vcfg, tiny_target, Source("curate", cm.fingerprint), shard)
    got = read_rows(store.stage_path("regenerate", "killed", resumed.shard.name))
    # The reference runs one conversation at a time: padding in a transformers batch moves float sums
    # enough to flip near-ties of the random tiny target, which would test padding, not vLLM.
    hf_cfg = vcfg.model_copy(update={"regenerate": vcfg.regenerate.model_copy(update={"engine": "hf",
                                                                                      "batch_size": 1})})
    ref = regenerate.run_shard(store, "hf", hf_cfg, tiny_target, Source("curate", cm.fingerprint), shard)
    want = read_rows(store.stage_path("regenerate", "hf", ref.shard.name))
    assert [r["sample_id"] for r in got] == [r["sample_id"] for r in want]  # nothing lost or duplicated
    assert _ids(got) == _ids(want)  # vLLM's greedy ids, resumed, equal transformers' uninterrupted ones
    assert '"engine": "vllm"' in got[0]["provenance"]
    assert not partial.exists()


def test_too_long_prompts_are_answered_without_failing_the_call(vllm_engine, hf_engine):
    from draftflow.engines.vllm import PROMPT_TOO_LONG

    chat = ChatFormat(hf_engine.tokenizer)
    short = chat.prompt_ids(CONVERSATIONS[0][0], enable_thinking=False)
    long = (short * (600 // len(short) + 1))[:600]  # past max_model_len=512
    out = vllm_engine.generate([GenRequest([], {}, p) for p in (short, long, short)], PARAMS)
    assert [c.finish_reason == PROMPT_TOO_LONG for c in out] == [False, True, False]
    assert out[1].ids == [] and out[1].prompt_tokens == 600 and out[0].ids == out[2].ids
