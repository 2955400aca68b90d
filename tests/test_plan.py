"""`draftflow plan`: sizes, free space and time before any work; extract's space check."""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest

from draftflow.contracts import Manifest, ShardEntry, StageResult
from draftflow.errors import DraftflowError
from draftflow.runs.plan import check_space, environment, free_space, plan, preflight, stage_sizes
from draftflow.stages.estimate import feature_bytes_per_token
from draftflow.stages.registry import spec, stage_names
from tests.conftest import tiny_config

# The tiny target: hidden 64, 8 layers; tests.conftest's tiny config taps 3 of them.
SHA = "0" * 64
TAPS, HIDDEN = 3, 64


def _tokenized(*tokens: int) -> dict:
    """A tokenize manifest with one train shard per token count (and an eval-free split)."""
    shards = [ShardEntry(name=f"s{i}.parquet", split="train", tokens=t, rows=4, bytes=1, sha256=SHA)
              for i, t in enumerate(tokens)]
    shards.append(ShardEntry(name="token_freq.parquet", kind="freq", tokens=0, rows=9, bytes=1, sha256=SHA))
    return _manifest("tokenize", shards, 4 * len(tokens), sum(tokens))


def _manifest(stage, shards, rows, tokens):
    return Manifest(stage=stage, fingerprint="fp", code_version="c", config={}, inputs={}, shards=tuple(shards),
                    rows_in=rows, rows_out=rows, dropped={}, tokens=tokens)


def test_plan_before_any_run_estimates_every_stage(tmp_path, tiny_target):
    cfg = tiny_config(tmp_path / "run")
    stages = plan(cfg, preflight(cfg))
    assert [s["state"] for s in stages] == ["to run"] + ["waits"] * (len(stage_names()) - 1)
    assert all(s["basis"] == "estimated" and s["rows"] > 0 for s in stages)
    # a stage with a time model has a time (one without, e.g. docs/extending.md's short_answers, is "unknown")
    assert all((s["seconds"] is not None) == (spec(s["stage"]).seconds is not None) for s in stages)
    by = {s["stage"]: s for s in stages}
    assert by["regenerate"]["tokens"] == by["regenerate"]["rows"] * cfg.regenerate.max_new_tokens
    assert by["tokenize"]["tokens"] <= by["tokenize"]["rows"] * cfg.tokenize.max_length
    ex = by["extract"]
    assert ex["bytes"] == ex["tokens"] * (TAPS * HIDDEN * 2 + 9)  # bf16 features + int64 id + mask byte
    assert by["evaluate"]["rows"] == cfg.evaluate.num_prompts
    env = environment(cfg)
    assert env["free_bytes"] > 0 and env["hardware"]["target"] == "cpu" and env["assumptions"]


def test_online_mode_plans_no_feature_bytes_and_no_extract_time(tmp_path, tiny_target):
    cfg = tiny_config(tmp_path / "run", "extract.mode=online")
    ex = next(s for s in plan(cfg, preflight(cfg)) if s["stage"] == "extract")
    assert ex["bytes"] == 0 and ex["seconds"] == 0.0 and ex["tokens"] > 0


def test_measured_upstream_sizes_replace_the_estimates(tmp_path):
    cfg = tiny_config(tmp_path / "run", "train.max_steps=null", "train.epochs=3")
    ctx = {"source_rows": 10_000, "prompt_tokens": 50.0, "taps": TAPS, "hidden": HIDDEN, "layer_params": 36864}
    manifests = {"curate": _manifest("curate", [], 7, 0), "tokenize": _tokenized(100, 40)}
    sizes = stage_sizes(cfg, manifests, ctx)
    assert sizes["tokenize"]["basis"] == "measured" and sizes["regenerate"]["basis"] == "estimated"
    assert sizes["extract"]["tokens"] == 140 and sizes["extract"]["rows"] == 8
    assert sizes["extract"]["bytes"] == 140 * feature_bytes_per_token(cfg, TAPS, HIDDEN)
    assert sizes["train"]["tokens"] == 3 * 140


def test_fp8_bytes_count_one_scale_per_token_and_tap(tmp_path):
    cfg = tiny_config(tmp_path / "run", "extract.dtype=float8")
    assert feature_bytes_per_token(cfg, 5, 4096) == 5 * 4096 * 1 + 5 * 4 + 9
    cfg = tiny_config(tmp_path / "run", "extract.dtype=float32")
    assert feature_bytes_per_token(cfg, 5, 4096) == 5 * 4096 * 4 + 9


def test_free_space_of_a_missing_root_is_its_nearest_existing_parent(tmp_path):
    assert free_space(str(tmp_path / "a" / "b" / "c")) == shutil.disk_usage(tmp_path).free
    assert free_space("s3://bucket/prefix") is None


def test_check_space_refuses_with_one_line_saying_needed_and_free(tmp_path, tiny_target):
    cfg = tiny_config(tmp_path / "run")
    need = (1500 + 1000) * feature_bytes_per_token(cfg, TAPS, HIDDEN)  # + the largest shard: merge headroom
    with pytest.raises(DraftflowError) as err:
        check_space(cfg, _tokenized(1000, 500), tiny_target, free=lambda root: 10_000)
    msg = str(err.value)
    assert "\n" not in msg and f"{need / 1024:.1f} KiB" in msg and "9.8 KiB free" in msg and "extract.force" in msg
    ok = check_space(cfg, _tokenized(1000, 500), tiny_target, free=lambda root: need)
    assert ok == {"needed": need, "free": need, "done": 0}
    assert check_space(cfg, _tokenized(10, 10), tiny_target, free=lambda root: None)["free"] is None  # S3


def test_bytes_a_resumed_extraction_already_wrote_count_as_done(tmp_path, tiny_target):
    cfg = tiny_config(tmp_path / "run")
    need = 2000 * feature_bytes_per_token(cfg, TAPS, HIDDEN)
    part = tmp_path / "run" / "extract" / "xfp" / "partial" / "s0" / "part-0.safetensors"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"x" * (need - 100))
    out = check_space(cfg, _tokenized(1000), tiny_target, free=lambda root: 100, fp="xfp")
    assert out == {"needed": need, "free": 100, "done": need - 100}


def test_force_and_online_mode_start_anyway(tmp_path, tiny_target):
    forced = tiny_config(tmp_path / "run", "extract.force=true")
    assert check_space(forced, _tokenized(1000), tiny_target, free=lambda root: 1)["needed"] > 1
    online = tiny_config(tmp_path / "run", "extract.mode=online")
    assert check_space(online, _tokenized(1000), tiny_target, free=lambda root: 1)["needed"] == 0


def test_extract_flow_checks_the_space_before_any_shard(tmp_path, tiny_target, monkeypatch):
    from flows.stages import extract_flow
    from tasks import stage_tasks

    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**6, 10**6 - 123, 123))
    monkeypatch.setattr(stage_tasks, "stage_shard", None)  # any shard task would fail differently
    cfg = tiny_config(tmp_path / "run")
    # extract's upstream as the registry has it (tokenize, or a stage put after it in a worked example's copy)
    tokenized = StageResult(stage=spec("extract").upstream[0], fingerprint="tok", status="ran", digest="d", path="p",
                            manifest=_tokenized(1000))
    target = {"path": tiny_target.path, "fingerprint": tiny_target.fingerprint}
    with pytest.raises(DraftflowError, match=r"extract needs .* but .* has 123 B free"):
        extract_flow.fn(cfg, target, tokenized)
    assert not (tmp_path / "run" / "extract").exists()


def test_cli_plan_prints_sizes_space_time_and_assumptions(tmp_path, tiny_target, capsys):
    from flows.cli import main

    assert main(["plan", "configs/tiny.yaml", "--set", f"root={tmp_path}/r"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert f"root {tmp_path}/r (" in lines[0] and "GiB free)" in lines[0] and "devices: target cpu" in lines[0]
    assert tuple(line.split()[0] for line in lines[1:]) == stage_names()
    extract = lines[1 + stage_names().index("extract")]
    assert "rows" in extract and "tokens" in extract and "MiB" in extract and "time" in extract
    assert f"free space at {tmp_path}/r:" in err and "estimated times assume:" in err and "TFLOP/s" in err


def test_train_bytes_count_the_drafter_the_trainer_builds(target, dcfg):
    """The plan's train size (its share of a full-device error) comes from the drafter's parameter count:
    checked against a real drafter's trainable parameters."""
    from draftflow.drafters.dflash.model import DFlashDrafter
    from draftflow.stages.estimate import KEPT_CHECKPOINTS, drafter_params
    from draftflow.training.checkpoint import KEEP_CHECKPOINTS

    tc = target.config
    layer = tc.hidden_size * tc.head_dim * 2 * (tc.num_attention_heads + tc.num_key_value_heads) \
        + 3 * tc.hidden_size * tc.intermediate_size  # as estimate.model_shape counts a target layer
    ctx = {"layer_params": layer, "taps": 3, "hidden": tc.hidden_size}
    trainable = sum(p.numel() for p in DFlashDrafter(dcfg, target).parameters() if p.requires_grad)
    assert abs(drafter_params(dcfg.num_layers, ctx) - trainable) / trainable < 0.02
    assert KEPT_CHECKPOINTS == KEEP_CHECKPOINTS


def test_preflight_loads_a_local_targets_tokenizer_and_config_once_per_content(tmp_path, tiny_target):
    """The chat and layer checks load the target through transformers (~5 s of every run's start on 2 cores);
    their answers are kept by the target's content, so a second run reads them, and an edited target (another
    fingerprint) is checked afresh. A check that fails keeps nothing."""
    from draftflow.kept import default_cache_dir

    kept = default_cache_dir() / "preflight"
    before = set(kept.glob("*")) if kept.is_dir() else set()
    good = tmp_path / "good"
    shutil.copytree(tiny_target.path, good)
    cfg = tiny_config(tmp_path / "run", f"target.path={good}")
    preflight(cfg)
    new = set(kept.glob("*")) - before
    assert sorted(p.read_text() for p in new) == ["8", "ok"]  # the tiny target's 8 layers; its template passed
    layers = next(p for p in new if p.read_text() == "8")
    layers.write_text("2")  # what a second run finds is what it uses: 2 layers cannot hold the config's taps
    with pytest.raises(DraftflowError, match="layer"):
        preflight(cfg)
    layers.write_text("8")
    preflight(cfg)
    assert set(kept.glob("*")) - before == new

    bad = tmp_path / "bad"
    shutil.copytree(tiny_target.path, bad)
    (bad / "chat_template.jinja").write_text("{{ raise_exception('no chat here') }}")
    with pytest.raises(DraftflowError, match="no chat here"):
        preflight(tiny_config(tmp_path / "run", f"target.path={bad}"))
    assert sorted(p.read_text() for p in set(kept.glob("*")) - before - new) == ["8"]  # its layers, not its chat
