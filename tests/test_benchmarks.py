"""Every benchmark still runs (smallest settings, no timing asserted): they import library internals
that move, and nothing else would notice until someone runs them on a GPU machine."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNS = {
    "train": ["--steps", "1"],
    "bench_features": ["--samples", "20", "--tokens", "16", "--width", "32", "--reads", "5"],
    "feature_store": ["--gb", "0.002", "--repeats", "1"],
    "tokenize": ["--conversations", "20", "--policies", "last_turn"],
    "curate": ["--rows", "300", "--workers", "1"],
    "regenerate": ["--engine", "hf", "--prompts", "2", "--max-new-tokens", "4", "--repeats", "1"],
    "evaluate": ["--kind", "both", "--tokens", "40", "--hidden", "32", "--window", "16"],
    "train_threads": ["--steps", "3", "--loads", "idle"],
    "small_rows": ["configs/tiny.yaml", "--rows", "1,3", "--repeats", "2"],
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_benchmark_runs_and_prints_a_ratio(name, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DRAFTFLOW_TORCH_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *RUNS[name]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert re.search(r"ratio|\d\.?\d*x\b", out), out[-2000:]  # "ratio 0.97" or "1.4x" against its baseline


def test_stage_floors_prints_every_stage_against_its_floor():
    """One row per stage (regenerate on the hf fallback: no vLLM here), each with a positive ratio."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DRAFTFLOW_TORCH_THREADS": "1"}
    args = ["--config", "configs/tiny.yaml", "--prompts", "2", "--max-new-tokens", "16", "--train-steps", "1",
            "--eval-prompts", "1", "--repeats", "1"]
    proc = subprocess.run([sys.executable, "-m", "benchmarks.stage_floors", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ratios = {m[1]: float(m[2]) for m in re.finditer(r"^(\w+) .*\|\s*([\d.]+) \| .+$", proc.stdout, re.M)}
    assert sorted(ratios) == ["evaluate", "extract", "regenerate", "train"], proc.stdout
    assert all(r > 0 for r in ratios.values()), ratios


def test_recipe_ablation_variants_set_eagle3s_scored_positions_and_only_eagle3s():
    from pydantic import ValidationError

    from benchmarks.recipe_ablation import VARIANTS, variant_config
    from draftflow.config import load_config

    eagle3 = load_config(str(ROOT / "configs/tiny-eagle3.yaml"), ["drafter.draftable=tokens"])
    assert variant_config(eagle3, VARIANTS["+init gamma measured +tokens"]).drafter.draftable == "tokens"
    paper = variant_config(eagle3, VARIANTS["paper"])  # the config's own choice does not leak into a variant
    assert paper.drafter.draftable == "target" and paper.train.recipe == "paper"  # the paper recipe's rule
    with pytest.raises(ValidationError, match="drafter.draftable"):  # a setting DFlash has not
        variant_config(load_config(str(ROOT / "configs/tiny.yaml")), VARIANTS["+init gamma measured +tokens"])
