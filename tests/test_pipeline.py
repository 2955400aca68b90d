"""The whole tiny pipeline through Prefect: end to end, reuse, crash and resume.

These run real flows against one session-scoped Prefect test server.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from draftflow.stages.registry import stage_names
from draftflow.store import sha256_file
from tests.conftest import n_stages, patch_stage, stage_of, tiny_config

STAGES = list(stage_names())  # the registry: the one list of stages


def _files(root: Path, stages: list[str]) -> dict[str, float]:
    """mtime of every committed file of the given stages (work folders excluded)."""
    return {str(p): p.stat().st_mtime_ns for s in stages for p in (root / s).rglob("*")
            if p.is_file() and "/work/" not in str(p)}


def _checkpoint_sha(summary: dict) -> str:
    return sha256_file(Path(summary["checkpoint"]) / "model.safetensors")


def _stage(summary: dict, name: str) -> dict:
    """A stage's entry of a run summary, by name (a worked example's copy has more stages)."""
    return next(s for s in summary["stages"] if s["stage"] == name)


@pytest.fixture(scope="module")
def uninterrupted(prefect_harness, tmp_path_factory):
    from flows.pipeline import pipeline

    root = tmp_path_factory.mktemp("uninterrupted") / "run"
    return root, pipeline(tiny_config(root))


def test_end_to_end_runs_every_stage_and_accounts_for_every_row(uninterrupted):
    root, summary = uninterrupted
    assert [s["stage"] for s in summary["stages"]] == STAGES
    assert all(s["status"] == "ran" for s in summary["stages"])
    for s in summary["stages"]:
        assert (Path(s["path"]) / "manifest.json").is_file()
        assert s["rows_in"] == s["rows_out"] + sum(s["dropped"].values())
    assert stage_of(summary, "curate")["dropped"] == {"duplicate": 1, "malformed_json": 1, "no_user_turn": 1}
    assert summary["tau"] >= 1.0  # evaluate also proved the decoding lossless, or it would have failed
    assert (Path(summary["checkpoint"]) / "model.safetensors").is_file()
    info = (root / "run.json").read_text()
    assert '"packages"' in info and '"git_revision"' in info and '"config"' in info


def test_second_run_reuses_every_stage_and_touches_nothing(uninterrupted):
    from flows.pipeline import pipeline

    root, first = uninterrupted
    before = _files(root, STAGES)
    again = pipeline(tiny_config(root))
    assert [s["status"] for s in again["stages"]] == ["reused"] * n_stages()
    assert again["tau"] == first["tau"] and again["checkpoint"] == first["checkpoint"]
    assert _files(root, STAGES) == before


def test_a_root_copied_elsewhere_reuses_every_stage(uninterrupted, tmp_path):
    """No absolute path enters a fingerprint (the export READMEs name the root as `<run root>`)."""
    import shutil

    from flows.pipeline import pipeline

    root, first = uninterrupted
    moved = tmp_path / "elsewhere" / "run"
    shutil.copytree(root, moved)
    again = pipeline(tiny_config(moved))
    assert [s["status"] for s in again["stages"]] == ["reused"] * n_stages()
    assert again["tau"] == first["tau"]
    readme = next(moved.glob("train/*/export/vllm/README.md")).read_text()
    assert str(root) not in readme and "<run root>/train/" in readme


def test_an_edited_export_is_not_reused(uninterrupted, tmp_path):
    """The manifest lists every export file's checksum: an edit after the run retrains (same drafter again)."""
    import shutil

    from flows.pipeline import pipeline

    root, first = uninterrupted
    copy = tmp_path / "edited" / "run"
    shutil.copytree(root, copy)
    config = next(copy.glob("train/*/export/vllm/config.json"))
    config.write_text(config.read_text().replace('"block_size"', '"block_size" ', 1))
    again = pipeline(tiny_config(copy))
    assert [s["status"] for s in again["stages"]] == ["reused"] * (n_stages() - 2) + ["ran", "reused"]
    assert _checkpoint_sha(again) == _checkpoint_sha(first)
    assert '"block_size" ' not in config.read_text()


def test_status_of_a_finished_run_reads_manifests_only(uninterrupted):
    """`draftflow status <run folder>` lists every stage complete without importing torch,
    transformers or Prefect (it reads manifests; a fresh interpreter shows what it imported)."""
    from tests.test_runstate import cli_imports

    root, _ = uninterrupted
    got, proc = cli_imports("status", str(root))
    assert got == {"rc": 0, "heavy": []}, proc.stderr
    assert proc.stdout.splitlines()[0].endswith(f"{n_stages()}/{n_stages()} stages complete")


def test_deleted_stage_output_is_recomputed_not_taken_from_a_cache(uninterrupted):
    import shutil

    from flows.pipeline import pipeline

    root, first = uninterrupted
    shutil.rmtree(root / "train")
    again = pipeline(tiny_config(root))
    assert _stage(again, "train")["status"] == "ran"
    assert _checkpoint_sha(again) == _checkpoint_sha(first)  # deterministic: the same drafter again


def test_crash_in_train_then_rerun_reuses_earlier_stages_and_equals_uninterrupted(
        uninterrupted, tmp_path, monkeypatch):
    import draftflow.training.loop as train_lib
    from draftflow.runs.runinfo import stage_status
    from flows.pipeline import pipeline

    real_save = train_lib.save_checkpoint

    def save_then_crash(*args, **kwargs):
        real_save(*args, **kwargs)
        raise RuntimeError("injected crash after a checkpoint")

    monkeypatch.setattr(train_lib, "save_checkpoint", save_then_crash)
    root = tmp_path / "run"
    with pytest.raises(RuntimeError, match="injected crash"):
        pipeline(tiny_config(root))
    train_dirs = list((root / "train").iterdir())
    assert not any((d / "manifest.json").exists() for d in train_dirs)  # nothing looks complete
    # Status names the checkpoint the rerun resumes from (each of Prefect's tries saved one before crashing).
    train = [s for s in stage_status(tiny_config(root)) if s["stage"] == "train"][0]
    newest = max((root / "train").glob("*/work/checkpoints/step_*"))
    assert train["state"] == "to run" and train["progress"] == {
        "resume_step": int(newest.name.removeprefix("step_")), "checkpoint": str(newest)}
    assert train["progress"]["resume_step"] % 8 == 0  # train.checkpoint_every=8
    before = _files(root, STAGES[:4])
    monkeypatch.setattr(train_lib, "save_checkpoint", real_save)
    resumed = pipeline(tiny_config(root))
    assert [s["status"] for s in resumed["stages"]] == ["reused"] * (n_stages() - 2) + ["ran", "ran"]
    assert _files(root, STAGES[:4]) == before  # earlier stages were not recomputed
    _, reference = uninterrupted
    assert _checkpoint_sha(resumed) == _checkpoint_sha(reference)
    assert resumed["tau"] == reference["tau"]


def test_failed_shard_is_the_only_one_recomputed(prefect_harness, tmp_path, monkeypatch):
    import draftflow.stages.extract as extract_lib
    from flows.pipeline import pipeline

    real = extract_lib.run_shard
    calls: list[str] = []

    def failing(store, fp, cfg, target, source, shard):
        calls.append(shard.name)
        if shard.name == "train-00002.parquet":
            raise RuntimeError("injected extract failure")
        return real(store, fp, cfg, target, source, shard)

    patch_stage(monkeypatch, "extract", run_shard=failing)
    cfg = tiny_config(tmp_path / "run")
    with pytest.raises(RuntimeError, match="injected extract failure"):
        pipeline(cfg)
    assert {"train-00000.parquet", "train-00001.parquet"} <= set(calls)
    calls.clear()
    patch_stage(monkeypatch, "extract", run_shard=lambda *a: calls.append(a[-1].name) or real(*a))
    summary = pipeline(cfg)
    assert calls == ["train-00002.parquet"]  # the finished shards came from the Prefect cache
    statuses = [s["status"] for s in summary["stages"]]
    at = [s["stage"] for s in summary["stages"]].index("extract")
    assert statuses[:at + 1] == ["reused"] * at + ["ran"]
    assert os.path.exists(Path(_stage(summary, "extract")["path"]) / "train-00002.safetensors")


def test_a_cached_shard_damaged_in_place_is_recomputed(prefect_harness, tmp_path, monkeypatch):
    import draftflow.stages.extract as extract_lib
    from flows.pipeline import pipeline

    cfg = tiny_config(tmp_path / "run")
    first = pipeline(cfg)
    extract_dir = Path(_stage(first, "extract")["path"])
    shard = extract_dir / "train-00001.safetensors"
    original = sha256_file(shard)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes: only a checksum can tell
    shard.write_bytes(bytes(data))
    (extract_dir / "manifest.json").unlink()  # the stage must be rebuilt from its (cached) shard tasks
    calls: list[str] = []
    real = extract_lib.run_shard
    patch_stage(monkeypatch, "extract", run_shard=lambda *a: calls.append(a[-1].name) or real(*a))
    again = pipeline(cfg)
    assert calls == ["train-00001.parquet"]  # the other shards came from the cache
    assert sha256_file(shard) == original
    assert _stage(again, "extract")["status"] == "ran" and again["tau"] == first["tau"]
