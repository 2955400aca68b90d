"""A regenerate shard killed with SIGKILL mid-shard resumes without losing or duplicating anything."""

import signal
import subprocess
import sys
from pathlib import Path

from draftflow.data.schema import read_rows
from draftflow.stages import curate, regenerate
from draftflow.stages.common import Source
from draftflow.stages.registry import stamp
from draftflow.store import Store
from tests.conftest import tiny_config
from tests.reliability.killable import kill_when_frozen

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = """
import sys, json, torch
torch.set_num_threads(1)
from draftflow.config import RunConfig
from draftflow.contracts import ShardEntry
from draftflow.stages import regenerate
from draftflow.stages.common import Source
from draftflow.store import Store
from draftflow.target import TargetRef
from tests.reliability.killable import arm_call
arm_call("draftflow.stages.regenerate", "save_partial", 2, sys.argv[3])  # the first chunk is on disk
cfg = RunConfig.model_validate_json(open(sys.argv[1]).read())
args = json.load(open(sys.argv[2]))
regenerate.run_shard(Store(cfg.root), "killed", cfg, TargetRef(**args["target"]), Source("curate", args["curate_fp"]),
                     ShardEntry.model_validate(args["shard"]))
"""


def _texts(rows):
    return [(r["sample_id"], [m["content"] for m in r["messages"]]) for r in rows]


def test_sigkill_mid_shard_then_rerun_equals_an_uninterrupted_run(tmp_path, tiny_target):
    import json

    cfg = tiny_config(tmp_path / "run", "regenerate.checkpoint_every=2")
    store = Store(cfg.root)
    cm = curate.run(store, stamp(cfg, "curate", {}), cfg)
    shard = [s for s in cm.shards if s.split == "train"][0]
    reference = regenerate.run_shard(store, "reference", cfg, tiny_target, Source("curate", cm.fingerprint), shard)

    (tmp_path / "cfg.json").write_text(cfg.model_dump_json())
    (tmp_path / "args.json").write_text(json.dumps({"target": {"path": tiny_target.path,
                                                               "fingerprint": tiny_target.fingerprint},
                                                    "curate_fp": cm.fingerprint, "shard": shard.to_json()}))
    marker = tmp_path / "frozen"
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path / "cfg.json"), str(tmp_path / "args.json"),
                             str(marker)], cwd=ROOT)
    partial = Path(store.stage_path("regenerate", "killed", "partial", shard.name))
    kill_when_frozen(proc, marker)  # frozen before its second checkpoint
    assert proc.returncode == -signal.SIGKILL
    done_before = len(read_rows(str(partial)))
    assert 0 < done_before < shard.rows  # killed mid-shard, after a checkpoint
    assert not Path(store.stage_path("regenerate", "killed", shard.name)).exists()  # nothing looks complete

    resumed = regenerate.run_shard(store, "killed", cfg, tiny_target, Source("curate", cm.fingerprint), shard)
    ref_rows = read_rows(store.stage_path("regenerate", "reference", reference.shard.name))
    got_rows = read_rows(store.stage_path("regenerate", "killed", resumed.shard.name))
    assert [r["sample_id"] for r in got_rows] == [r["sample_id"] for r in ref_rows]  # no loss, no duplicate
    assert _texts(got_rows) == _texts(ref_rows)  # greedy: the same answers
    assert not partial.exists()  # the checkpoint is cleared once the shard is committed
