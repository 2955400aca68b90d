"""`draftflow status`: answers without torch, transformers or Prefect, and shows how far an
unfinished stage got (shards committed, in-shard checkpoints, train's resume step)."""

from __future__ import annotations

import json
import subprocess
import sys

from draftflow.runs.runinfo import stage_status
from draftflow.runs.runstate import CKPT_DIR, MIRROR_DONE, PARTIAL, stage_states, train_progress, train_work_dir
from draftflow.stages.registry import stage_names
from draftflow.store import Store
from flows.status import _progress
from tests.conftest import ROOT, tiny_config

HEAVY = ("torch", "transformers", "prefect")
# Runs the CLI in a fresh interpreter, then prints which heavy libraries it imported (last line).
PROBE = ("import json, sys, flows.cli\n"
         "rc = flows.cli.main(sys.argv[1:])\n"
         f"print(json.dumps({{'rc': rc, 'heavy': [m for m in {HEAVY!r} if m in sys.modules]}}))")


def cli_imports(*args: str) -> tuple[dict, subprocess.CompletedProcess]:
    """Run `draftflow <args>` in a fresh interpreter; return its exit code and the heavy modules it
    imported, and the process (stdout without the last line is the CLI's)."""
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc


def test_status_and_a_config_error_import_no_torch_transformers_or_prefect(tmp_path, tiny_target):
    # tiny_target: the tiny target exists in this session's cache (building it would need torch).
    got, proc = cli_imports("status", "configs/tiny.yaml", "--set", f"root={tmp_path}/r")
    assert got == {"rc": 0, "heavy": []}, proc.stderr
    assert f"0/{len(stage_names())} stages complete" in proc.stdout
    got, proc = cli_imports("run", "configs/tiny.yaml", "--set", "train.lr=-1")  # a config error
    assert got == {"rc": 2, "heavy": []}, proc.stderr
    assert "train.lr" in proc.stderr


def test_status_shows_shards_done_and_rows_checkpointed_in_an_unfinished_shard(tmp_path, tiny_target):
    """Regenerate stopped after one of two shards (and a few rows of the second): `1/2 shards`."""
    from draftflow.data.schema import read_rows
    from draftflow.stages import curate, regenerate
    from draftflow.stages.common import Source, manifest_digest
    from draftflow.stages.registry import stage_inputs, stamp

    cfg = tiny_config(tmp_path / "run", "curate.shard_rows=24")  # two train shards
    store = Store(cfg.root)
    inputs = stage_inputs(cfg, "curate", None, {})
    cm = curate.run(store, stamp(cfg, "curate", inputs), cfg)
    rfp = stamp(cfg, "regenerate", stage_inputs(cfg, "regenerate", tiny_target.fingerprint,
                                                {"curate": manifest_digest(cm)})).fingerprint
    first, second = cm.data_shards("train")[:2]
    res = regenerate.run_shard(store, rfp, cfg, tiny_target, Source.of(cm), first)
    rows = read_rows(store.stage_path("regenerate", rfp, res.shard.name))
    regenerate.save_partial(store, rfp, second.name, rows[:3], [])  # the second shard's in-shard checkpoint

    status = {s["stage"]: s for s in stage_status(cfg, tiny_target)}
    assert status["curate"]["state"] == "complete"
    regen = status["regenerate"]
    assert regen["state"] == "to run" and regen["fingerprint"] == rfp
    assert regen["progress"] == {"shards_done": 1, "shards": 2, "partial_rows": 3, "partial_parts": 0}
    assert _progress(regen["progress"]) == "1/2 shards done, 3 rows checkpointed in unfinished shards"
    assert status["tokenize"]["state"] == "waits" and status["tokenize"]["progress"] is None
    # The CLI on the run folder: curate's counts, regenerate's progress, and still no torch.
    from draftflow.runs.runinfo import record_run

    record_run(cfg)
    got, proc = cli_imports("status", cfg.root)
    assert got == {"rc": 0, "heavy": []}, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1].split()[:2] == ["curate", "complete"]
    assert lines[3].split() == ["1/2", "shards", "done,", "3", "rows", "checkpointed", "in", "unfinished", "shards"]
    # The same walk as `draftflow plan` (which also sizes and times the stages).
    from draftflow.runs.plan import plan

    assert [{k: s[k] for k in ("stage", "state", "fingerprint")} for s in plan(cfg, tiny_target)] == \
        stage_states(cfg, tiny_target.fingerprint)[0]


def test_sizes_in_status_are_written_as_plan_writes_them():
    from draftflow.runs.plan import human_bytes
    from flows.status import _size

    for n in (0, 1023, 1024, 16_600, 1 << 20, 3 << 40, 5 << 50):
        assert _size(n) == human_bytes(n)
    assert _size(None) == "-"


def test_train_resumes_from_its_newest_complete_checkpoint(tmp_path):
    store = Store(str(tmp_path / "run"))
    assert train_progress(store, "train", "fp") == {"resume_step": None, "checkpoint": None}
    assert _progress(train_progress(store, "train", "fp")) == "no checkpoint yet: starts at step 0"
    ckpts = tmp_path / "run" / "train" / "fp" / "work" / CKPT_DIR
    for name in ("step_00000008", "step_00000016", ".tmp_step_00000024"):  # the last is being written
        (ckpts / name).mkdir(parents=True)
    got = train_progress(store, "train", "fp")
    assert got == {"resume_step": 16, "checkpoint": str(ckpts / "step_00000016")}
    assert _progress(got).startswith("resumes from step 16 (")


def test_train_on_a_remote_root_resumes_from_the_checkpoint_copied_to_the_store(s3_env):
    store = Store("s3://status-bucket/run")
    store.fs.mkdir("status-bucket")
    mirror = store.stage_path("train", "fp", "work", CKPT_DIR)
    store.fs.pipe_file(f"{mirror}/step_00000008/{MIRROR_DONE}", b"")
    store.fs.pipe_file(f"{mirror}/step_00000016/model.safetensors", b"copy under way, no marker yet")
    assert train_progress(store, "train", "fp")["resume_step"] == 8


def test_the_names_status_reads_are_the_stages_own(tmp_path):
    """runstate repeats a few names the stages own (to stay free of torch): they must agree."""
    from draftflow.stages import extract, regenerate, train
    from draftflow.training import checkpoint, mirror

    assert (CKPT_DIR, MIRROR_DONE) == (checkpoint.CKPT_DIR, mirror.MIRROR_DONE)
    for store in (Store(str(tmp_path)), Store("s3://bucket/run")):
        assert train_work_dir(store, "train", "fp") == train.work_dir(store, "fp")
        assert train.checkpoint_mirror(store, "fp") in (None, store.stage_path("train", "fp", "work", CKPT_DIR))
        assert regenerate._partial_paths(store, "fp", "s.parquet")[0] == store.stage_path(
            "regenerate", "fp", PARTIAL, "s.parquet")
        assert extract._partial_dir(store, "fp", "s.safetensors") == store.stage_path("extract", "fp", PARTIAL, "s")
