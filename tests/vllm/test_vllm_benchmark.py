"""`benchmarks.regenerate --engine vllm` runs at its smallest settings and prints both of its ratios."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_vllm_regenerate_benchmark_prints_ratios_against_bare_vllm_and_transformers():
    args = ["--engine", "vllm", "--prompts", "4", "--max-new-tokens", "8", "--repeats", "1",
            "--vllm", "max_model_len=512"]
    proc = subprocess.run([sys.executable, "-m", "benchmarks.regenerate", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for ratio in ("ratio draftflow/raw", "ratio vLLM/transformers"):
        assert re.search(rf"{re.escape(ratio)}\s+\d+\.\d+", out), ratio
    assert "token counts differ" not in out  # draftflow and bare vLLM produced the same tokens
