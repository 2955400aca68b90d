"""SIGKILL at 5+ points in every stage, resume, and get an uninterrupted run's outputs byte for byte.

One run sequence in one root: a run is started with one kill point armed (`tests/reliability/killable.py`),
SIGKILLed (its whole process group) the moment that event happens, and the next run resumes and is
killed at the next point, and so on down the pipeline; a last run completes it. Its manifests (which
hold every shard's sha256, the checkpoint's weights and τ) must equal an uninterrupted run's in the same
root byte for byte, and it must leave no work/ or partial/ folders, temp files or empty folders (a kill
right after a manifest leaves them; the next run tidies a complete stage it reuses). No run's log may show a failed
task or a traceback: a task that failed and passed on Prefect's retry still ends the run well.
30 kills (5 per stage) and 32 runs: ~6 min on 2 idle cores. Runs start from a copy of the code taken
when the module starts: a stage's fingerprint holds its code's hash, and an edit to the working tree
mid-test would start the stages after it afresh.

Kill points (a count is within that process; `file:` = right after that commit, `call:` = at that call):
curate      1st source part, 2nd source part, 1st merged shard, 10th merged shard, its manifest
regenerate  1st in-shard checkpoint, 5th in-shard checkpoint, 1st shard, 10th shard, its manifest
tokenize    1st shard, 3rd token-count file, 10th shard, token_freq.parquet, its manifest
extract     1st in-shard part, 1st shard, 3rd in-shard part, 8th shard, its manifest
train       step 3 (no checkpoint yet), 2nd checkpoint (step 8), step 10 after resuming (step 18), an export
            committed (weights and metrics committed, the manifest not yet), its manifest
evaluate    1st speculative decode, 3rd drafting step, 2nd greedy reference, report.json, its manifest
"""

from __future__ import annotations

import pytest

from tests.reliability.procs import assert_equals_uninterrupted, failures_in, run_killed_at, run_to_end

pytestmark = pytest.mark.reliability

KILL_POINTS = {
    "curate": ["file:curate/*/parts/part-*:1", "file:curate/*/parts/part-*:2", "file:curate/*/train-*:1",
               "file:curate/*/train-*:10", "file:curate/*/manifest.json:1"],
    "regenerate": ["file:regenerate/*/partial/train-*:1", "file:regenerate/*/partial/train-*:5",
                   "file:regenerate/*/train-*:1", "file:regenerate/*/train-*:10", "file:regenerate/*/manifest.json:1"],
    "tokenize": ["file:tokenize/*/train-*:1", "file:tokenize/*/freq-train-*:3", "file:tokenize/*/train-*:10",
                 "file:tokenize/*/token_freq.parquet:1", "file:tokenize/*/manifest.json:1"],
    "extract": ["file:extract/*/partial/*/part-*:1", "file:extract/*/train-*:1", "file:extract/*/partial/*/part-*:3",
                "file:extract/*/train-*:8", "file:extract/*/manifest.json:1"],
    "train": ["call:draftflow.training.loop:_train_step:3", "file:train/*/work/checkpoints/step_*:2",
              "call:draftflow.training.loop:_train_step:10", "file:train/*/export/vllm/README.md:1",
              "file:train/*/manifest.json:1"],
    "evaluate": ["call:draftflow.evaluation.cached:speculative_generate_cached:1",  # evaluate.kv_cache (default)
                 "call:draftflow.evaluation.cached:propose_cached:3",
                 "call:draftflow.evaluation.cached:greedy_along:2", "file:evaluate/*/report.json:1",
                 "file:evaluate/*/manifest.json:1"],
}


def test_sigkill_at_every_kill_point_then_resume_equals_an_uninterrupted_run(env, uninterrupted):
    root, (want_manifests, want_files) = uninterrupted
    logs = root.parent / "logs"
    logs.mkdir()
    for stage, points in KILL_POINTS.items():
        for i, point in enumerate(points):
            run_killed_at(env, str(root), point, logs / f"{stage}-{i}.log")
    run_to_end(env, str(root), logs / "final.log")
    assert_equals_uninterrupted(root, want_manifests, want_files)
    assert failures_in(sorted(logs.glob("*.log"))) == [], "a task failed (and was retried) in a killed or resumed run"
