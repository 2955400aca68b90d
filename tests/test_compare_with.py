"""`evaluate.compare_with` (other trained drafters beside the run's own) and the alignment report (issue 15, 3 and 7).

Real pieces: the code-built tiny Qwen3 target, a real DFlash drafter saved and exported in the vLLM
format, loaded back by `load_exported`, and the KV-cached decoding loop. The whole-pipeline case (a DFlash
run comparing with an EAGLE-3 trained in the same root) is `test_compare_with_eagle3_in_the_same_root`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftflow.config import EvaluateConfig, load_config
from draftflow.drafters.dflash.export import export_vllm_dflash
from draftflow.drafters.dflash.model import DFlashDrafter
from draftflow.drafters.registry import load_exported
from draftflow.errors import ConfigError, LosslessError
from draftflow.evaluation.alignment import alignment_line, alignment_report
from draftflow.evaluation.cached import evaluate_prompts
from draftflow.evaluation.compare_with import (
    check_compare_with,
    check_target,
    decode_others,
    fingerprint_input,
    resolve,
    resolve_all,
    rounding_for,
)
from draftflow.store import Store
from tests.conftest import MASK_ID, stage_of


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, MASK_ID, (3, 5), generator=g).tolist()


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory, target, dcfg):
    torch.manual_seed(3)
    ckpt = tmp_path_factory.mktemp("ckpt")
    DFlashDrafter(dcfg, target).save(ckpt)
    return export_vllm_dflash(ckpt, tmp_path_factory.mktemp("export") / "vllm", target.config)


def test_a_name_that_is_nothing_is_one_line(tmp_path):
    for name in ("0123456789abcdef", str(tmp_path / "nowhere")):
        with pytest.raises(ConfigError, match="evaluate.compare_with") as err:
            check_compare_with(str(tmp_path), [name], "tfp", str(tmp_path))
        assert "\n" not in str(err.value) and name in str(err.value)


def test_an_export_is_resolved_fingerprinted_and_checked_against_the_target(tmp_path, export_dir, target):
    other = resolve(Store(str(tmp_path)), str(export_dir))
    assert other.label.startswith("drafter:dflash@") and other.folder == str(export_dir)
    before = fingerprint_input(str(tmp_path), [str(export_dir)])
    check_target(other, "any", target.config.to_dict())  # same hidden size and vocabulary
    wrong = target.config.to_dict() | {"hidden_size": 128}
    with pytest.raises(ConfigError, match="hidden_size 64 but the target has 128"):
        check_target(other, "any", wrong)
    # A changed export file changes what evaluate's fingerprint takes (a re-export re-runs evaluate).
    extra = export_dir / "README.md"
    old = extra.read_text() if extra.exists() else None
    extra.write_text("changed")
    try:
        assert fingerprint_input(str(tmp_path), [str(export_dir)]) != before
    finally:
        extra.unlink() if old is None else extra.write_text(old)
    two = resolve_all(str(tmp_path), [str(export_dir), str(export_dir)])
    assert len({o.label for o in two}) == 2  # the same drafter twice gets two report keys


def test_an_export_rounds_its_features_as_its_training_did(tmp_path, export_dir, target):
    import shutil

    from draftflow.drafters.export import write_trained_on

    bare = resolve(Store(str(tmp_path)), str(export_dir))  # exported by hand: the run's dtype, said in the log
    assert bare.extract_dtype is None
    loaded = load_exported(export_dir, target)
    assert rounding_for(bare, loaded, "bfloat16").keywords["dtype"] == "bfloat16"
    trained = tmp_path / "train-export"
    shutil.copytree(export_dir, trained)
    write_trained_on(trained, {"extract_dtype": "float8", "features": "stored", "drafter": "dflash"})
    other = resolve(Store(str(tmp_path)), str(trained))
    assert other.extract_dtype == "float8"
    assert rounding_for(other, loaded, "bfloat16").keywords["dtype"] == "float8"
    assert other.digest != bare.digest  # the record is part of what evaluate's fingerprint takes


def test_other_drafters_decode_the_same_prompts_losslessly(tmp_path, target, dcfg, prompts, export_dir):
    ecfg = EvaluateConfig(max_new_tokens=12, device="cpu")
    torch.manual_seed(3)
    own = DFlashDrafter(dcfg, target).eval()
    stats = evaluate_prompts(target, own, prompts, ecfg, set())
    other = resolve(Store(str(tmp_path)), str(export_dir))
    loaded = load_exported(export_dir, target).eval()
    rounding = rounding_for(other, loaded, "bfloat16")
    report = decode_others(target, [(other, loaded, rounding)], prompts, stats["outputs"], ["a", "b", "a"], ecfg, set())
    got = report[other.label]
    # The export holds the same weights as `own`: same prompts, same loop, same tokens → same steps.
    assert got["prompts"] == stats["prompts"] and got["tokens"] == stats["tokens"]
    assert got["architecture"] == "DFlashDrafter" and set(got["categories"]) == {"a", "b"}
    assert got["tau"] == pytest.approx(stats["tau"], abs=0.5)
    bad = [o[:-1] + [(o[-1] + 1) % MASK_ID] for o in stats["outputs"]]  # a reference it cannot reproduce
    with pytest.raises(LosslessError, match=f"evaluate.compare_with {export_dir}"):
        decode_others(target, [(other, loaded, rounding)], prompts, bad, ["a"] * 3, ecfg, set())


def test_alignment_report_is_reported_and_skipped_for_non_dflash(target, dcfg, prompts):
    torch.manual_seed(4)
    drafter = DFlashDrafter(dcfg, target).eval()
    outputs = [list(range(10 + i, 30 + i)) for i in range(len(prompts))]  # all-distinct tokens: every slot counts
    rep = alignment_report(target, drafter, prompts, outputs)
    assert set(rep) == {"offset", "positions", "match", "warning", "conclusive"}
    assert set(rep["match"]) == {"-1", "0", "+1"} and rep["positions"] > 0
    # An untrained drafter matches a few tokens by chance at some offset: no evidence, so no warning.
    assert not rep["conclusive"] and rep["warning"] is None, rep
    json.dumps(rep)  # report.json material
    assert "slot alignment" in alignment_line(rep)
    from types import SimpleNamespace

    from draftflow.drafters.eagle3.spec import SPEC as EAGLE3

    eagle3 = SimpleNamespace(config=SimpleNamespace(architecture=EAGLE3.architecture))  # a kind without slots
    assert alignment_report(target, eagle3, prompts, outputs) is None
    shifted = rep | {"offset": 1, "warning": "labels look shifted by +1: check the objective"}
    assert "warning: labels look shifted by +1" in alignment_line(shifted)
    # Answers shorter than a block (a barely trained demo stops early) leave nothing to count, not an error.
    short = alignment_report(target, drafter, [[5, 6]] * 2, [[7], [8, 9, 10]])
    assert short["positions"] == 0 and short["warning"] is None


def test_compare_with_is_a_config_field_that_enters_the_evaluate_fingerprint(tmp_path, export_dir):
    from draftflow.stages.registry import stage_inputs

    cfg = load_config(None, [f"root={tmp_path}", f"evaluate.compare_with=[{json.dumps(str(export_dir))}]"])
    inputs = stage_inputs(cfg, "evaluate", "t", {"curate": "c", "train": "d"})
    assert inputs["compare_with"] == fingerprint_input(str(tmp_path), [str(export_dir)])
    plain = load_config(None, [f"root={tmp_path}"])
    assert "compare_with" not in stage_inputs(plain, "evaluate", "t", {"curate": "c", "train": "d"})


def test_compare_with_eagle3_in_the_same_root(prefect_harness, tmp_path):
    """A DFlash run whose evaluate decodes an EAGLE-3 trained in the same root on its very prompts."""
    from draftflow.runs.plan import preflight
    from flows.pipeline import pipeline
    from tests.conftest import tiny_config
    from tests.test_eagle3_pipeline import eagle3_config

    root = tmp_path / "run"
    eagle3 = pipeline(eagle3_config(root, "train.max_steps=10"))
    e3_fp = stage_of(eagle3, "train")["fingerprint"]
    cfg = tiny_config(root, f"evaluate.compare_with=[{e3_fp}]")
    preflight(cfg)  # the named drafter exists and was trained for this target
    summary = pipeline(cfg)
    evaluate = stage_of(summary, "evaluate")
    report = json.loads((Path(evaluate["path"]) / "report.json").read_text())
    label = f"drafter:eagle3@{e3_fp[:8]}"
    other = report["baselines"][label]
    # Identical prompts (the run's prompt_set), the same tokens (lossless-checked), its own chain depth.
    assert other["prompts"] == report["prompts"] and other["tokens"] == report["tokens"]
    assert other["architecture"] == "Eagle3Drafter" and len(other["acceptance_rate"]) == 4
    assert other["source"] == e3_fp and other["tau"] >= 1.0
    md = (Path(evaluate["path"]) / "report.md").read_text()
    assert f"| {label} |" in md and "slot alignment" in md
    assert set(report["alignment"]["match"]) == {"-1", "0", "+1"}
    # Without the comparison it is another evaluation (the comparison is in the fingerprint).
    assert evaluate["fingerprint"] != stage_of(pipeline(tiny_config(root)), "evaluate")["fingerprint"]
    with pytest.raises(ConfigError, match="ffffffffffffffff") as err:
        preflight(tiny_config(root, "evaluate.compare_with=[ffffffffffffffff]"))
    assert "\n" not in str(err.value)
