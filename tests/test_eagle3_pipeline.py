"""`drafter.kind: eagle3` end to end: configs/tiny-eagle3.yaml through the real Prefect pipeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import ROOT, n_stages, stage_of

OVERRIDES = ["curate.shard_rows=16", "regenerate.max_new_tokens=24", "train.max_steps=40",
             "train.checkpoint_every=20", "evaluate.max_new_tokens=16", "evaluate.num_prompts=2"]


def eagle3_config(root: Path, *extra: str):
    """configs/tiny-eagle3.yaml trimmed like `tests.conftest.tiny_config` (the three small sources)."""
    from draftflow.config import load_config

    cfg = load_config(ROOT / "configs" / "tiny-eagle3.yaml", [f"root={root}", *OVERRIDES, *extra])
    cfg.curate.sources = [s for s in cfg.curate.sources if s.name != "prompts"]
    return cfg


def test_eagle3_pipeline_trains_evaluates_and_exports(prefect_harness, tmp_path):
    from flows.pipeline import pipeline

    summary = pipeline(eagle3_config(tmp_path / "run"))
    assert [s["status"] for s in summary["stages"]] == ["ran"] * n_stages()
    assert summary["tau"] >= 1.0  # measured by decoding; evaluate fails unless it was lossless
    extract_dir = Path(stage_of(summary, "extract")["path"])
    manifest = json.loads((extract_dir / "manifest.json").read_text())
    assert all(s["layer_ids"] == [1, 3, 4, -1] for s in manifest["shards"])  # default taps + FINAL
    train_dir = Path(summary["checkpoint"]).parent
    config = json.loads((train_dir / "checkpoint" / "config.json").read_text())
    assert config["architecture"] == "Eagle3Drafter" and config["draft_vocab_size"] == 256
    vllm = json.loads((train_dir / "export" / "vllm" / "config.json").read_text())
    spec = json.loads((train_dir / "export" / "speculators" / "config.json").read_text())
    assert vllm["architectures"] == ["LlamaForCausalLMEagle3"] and spec["speculators_model_type"] == "eagle3"
    for fmt in ("vllm", "speculators"):
        assert (train_dir / "export" / fmt / "model.safetensors").is_file()
    report = json.loads((Path(stage_of(summary, "evaluate")["path"]) / "report.json").read_text())
    assert report["tau"] == summary["tau"] and len(report["acceptance_rate"]) == 4  # ttt_steps drafts
    # where evaluate's time went, phase by phase in the order they ran (engine hf: no vLLM phase)
    assert list(report["phase_seconds"]) == ["decode", "baselines", "alignment", "ddtree"]
    assert all(s >= 0 for s in report["phase_seconds"].values()) and report["phase_seconds"]["decode"] > 0
    md = (Path(stage_of(summary, "evaluate")["path"]) / "report.md").read_text()
    assert "Where this stage's time went (this machine, under its load): decode " in md


def test_eagle3_pipeline_with_online_features(prefect_harness, tmp_path):
    from flows.pipeline import pipeline

    summary = pipeline(eagle3_config(tmp_path / "run", "extract.mode=online", "train.max_steps=10"))
    train = json.loads((Path(stage_of(summary, "train")["path"]) / "manifest.json").read_text())
    assert train["extra"]["features"] == "online" and train["extra"]["metrics"]["steps"] == 10
    assert summary["tau"] >= 1.0


@pytest.mark.parametrize("bad, match", [(["extract.engine=vllm"], "extract.engine=hf"),
                                        (["drafter.target_layer_ids=[1, 2]"], "exactly 3 taps")])
def test_eagle3_settings_that_cannot_work_are_one_line_config_errors(tmp_path, bad, match):
    from draftflow.config import TargetConfig
    from draftflow.drafters.taps import feature_ids
    from draftflow.engines.capture import make_capture_engine
    from draftflow.errors import ConfigError

    cfg = eagle3_config(tmp_path / "run", *bad)
    with pytest.raises(ConfigError, match=match):
        ids = feature_ids(cfg.drafter, TargetConfig().tiny.num_layers)
        make_capture_engine(cfg.extract.engine, "unused", ids, vllm_cfg=cfg.regenerate.vllm)
