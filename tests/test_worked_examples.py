"""docs/extending.md's three worked examples, applied exactly as written to a copy of the repository: a stage
before tokenize (`short_answers`), a stage after it (`repetitive_answers`) and a drafter kind (`flat`). Each
touches one new module or folder and one registry line; with all three in, the copy's fast tier passes, and so do
its slow tests of the stages, whose pipelines (DFlash, EAGLE-3, the sampled softmax, online features, S3, Ray)
all meet both new stages, and its slow tests marked `machinery` (servers, workers, clusters), which run only there
in .ci/run. Then the tiny pipeline trains, exports and evaluates the new kind through both stages from the CLI, and
`plan` and `status` read its root (`tests/docsteps.py` reads the steps)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docsteps import apply, steps

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "extending.md").read_text()
STAGE, AFTER, KIND = "Adding a stage (", "Adding a stage after tokenize", "Adding a drafter kind"


def test_each_example_touches_one_new_module_and_one_registry_line(tmp_path):
    if (ROOT / "draftflow/stages/short_answers.py").exists():
        pytest.skip("the examples are in already (this is the copy the slow test below made)")
    for rel in ("draftflow/stages/registry.py", "draftflow/drafters/taps.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    stage = apply(tmp_path, steps(DOC, STAGE))
    assert stage == {"draftflow/stages/short_answers.py", "draftflow/stages/registry.py"}
    after = apply(tmp_path, steps(DOC, AFTER))
    assert after == {"draftflow/stages/repetitive_answers.py", "draftflow/stages/registry.py"}
    kind = apply(tmp_path, steps(DOC, KIND))
    assert {p for p in kind if not p.startswith("draftflow/drafters/flat/")} == {"draftflow/drafters/taps.py"}
    def new_lines(rel: str) -> tuple[list[str], int]:
        before, after = (ROOT / rel).read_text().splitlines(), (tmp_path / rel).read_text().splitlines()
        return [line for line in after if line not in before], len(after) - len(before)

    added, grown = new_lines("draftflow/stages/registry.py")  # one entry (two lines) put in for each stage
    assert [a.lstrip()[:30] for a in added[::2]] == ['StageSpec("short_answers", abo', 'StageSpec("repetitive_answers"']
    assert grown == len(added) == 4
    added, grown = new_lines("draftflow/drafters/taps.py")  # one line changed
    assert added == ['KINDS = ("dflash", "eagle3", "flat")'] and grown == 0


def test_a_step_that_cannot_apply_fails_by_name(tmp_path):
    (tmp_path / "a.py").write_text("X = 1\nX = 2\n")
    with pytest.raises(AssertionError, match=r"a.py: 2 lines start with 'X ='"):
        apply(tmp_path, [({"edit": "a.py"}, "X = 3\n")])


def _copy_repo(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)


def _examples_copy(tmp_path: Path) -> tuple[Path, dict]:
    """A copy of the repository with the three examples applied, and the environment its tests and CLI run in."""
    repo = tmp_path / "repo"
    _copy_repo(repo)
    apply(repo, steps(DOC, STAGE) + steps(DOC, AFTER) + steps(DOC, KIND))
    # Its own cache, as a fresh `make test-fast` has: sharing this session's, a test that counts S3 bytes found the
    # download an earlier test of this session had cached (Store.local_path) and failed under `make test`.
    return repo, {**os.environ, "PYTHONPATH": str(repo), "DRAFTFLOW_CACHE": str(tmp_path / "cache")}


# The copy's suite in three tiers, each its own test so .ci/run can give them to different lanes (-k): the fast tier,
# the slow tests of the stages and their wiring (every pipeline in them meets both new stages), and the slow tests
# marked `machinery` (servers, workers, clusters, launchers, benchmarks), which run only here in .ci/run.
TIERS = {"fast": "not slow", "stages": "slow and not machinery", "machinery": "slow and machinery"}


@pytest.mark.slow
@pytest.mark.parametrize("tier", TIERS)
def test_the_examples_as_written_keep_the_suite_green(tier, tmp_path):
    repo, env = _examples_copy(tmp_path)
    marks = f"{TIERS[tier]} and not vllm and not reliability"
    suite = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", marks,
                            "--ignore=tests/test_worked_examples.py"], cwd=repo, env=env, capture_output=True,
                           text=True, timeout=3600)
    assert suite.returncode == 0, suite.stdout[-4000:] + suite.stderr[-2000:]
    assert " passed" in suite.stdout.strip().splitlines()[-1], suite.stdout[-2000:]


@pytest.mark.slow
def test_the_examples_as_written_run_from_the_cli(tmp_path):
    repo, env = _examples_copy(tmp_path)
    run_root = tmp_path / "run"
    small = ["train.max_steps=100", "evaluate.num_prompts=6", "evaluate.ddtree_budgets=[1]"]  # the run, not its tau
    args = ["configs/tiny.yaml", "--set", f"root={run_root}", "--set", "drafter.kind=flat", "--set",
            "drafter.flat_slots=3", *(a for kv in small for a in ("--set", kv))]
    run = subprocess.run([sys.executable, "-m", "flows.cli", "run", *args], cwd=repo, env=env, capture_output=True,
                         text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    stages = {p.name: p for p in run_root.iterdir() if p.is_dir() and not p.name.startswith("_")}
    assert {"short_answers", "tokenize", "train", "evaluate"} <= set(stages)
    manifest = lambda stage: json.loads(next(stages[stage].glob("*/manifest.json")).read_text())  # noqa: E731
    assert set(manifest("tokenize")["inputs"]) >= {"short_answers"} and "regenerate" not in manifest("tokenize")[
        "inputs"]
    ours = manifest("short_answers")
    assert ours["rows_in"] == manifest("regenerate")["rows_out"] and ours["rows_out"] == manifest("tokenize")["rows_in"]
    train = next(stages["train"].glob("*"))
    checkpoint = json.loads((train / "checkpoint" / "config.json").read_text())
    assert checkpoint["architecture"] == "FlatDFlashDrafter"
    drafter = manifest("train")["config"]["drafter"]  # the kind's own setting, and DFlash's from tiny.yaml, kept
    assert drafter["flat_slots"] == 3 and drafter["block_size"] == 8 and "ttt_steps" not in drafter
    assert (train / "export" / "vllm" / "model.safetensors").is_file()
    report = json.loads(next(stages["evaluate"].glob("*/report.json")).read_text())
    assert report["tau"] >= 1.0
    after = manifest("repetitive_answers")  # the stage after tokenize: extract read it, token counts passed on
    assert after["rows_in"] == after["rows_out"] + sum(after["dropped"].values())
    assert after["extra"]["carried"]["token_counts"]["stage"] == "tokenize"

    # The kind's setting belongs to it: on another kind, or misspelt, one line at once, naming the key.
    for kind, key in (("dflash", "drafter.flat_slots"), ("flat", "drafter.flat_slot")):
        bad = subprocess.run([sys.executable, "-m", "flows.cli", "plan", "configs/tiny.yaml", "--set",
                              f"root={run_root}", "--set", f"drafter.kind={kind}", "--set", f"{key}=3"], cwd=repo,
                             env=env, capture_output=True, text=True, timeout=600)
        assert bad.returncode != 0 and f"unknown config key '{key}' for drafter.kind {kind}" in bad.stderr, bad.stderr
        assert "Traceback" not in bad.stderr

    # `plan` and `status` read the root through the same wiring, the new stages included. (EAGLE-3, the sampled
    # softmax and online features through both new stages: the copy's slow tier above, whose pipelines all meet them.)
    for cmd in ("plan", "status"):
        out = subprocess.run([sys.executable, "-m", "flows.cli", cmd, *args], cwd=repo, env=env, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0 and "repetitive_answers" in out.stdout, (cmd, out.stdout + out.stderr)
    assert "8/8 stages complete" in out.stdout, out.stdout
