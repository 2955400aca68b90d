"""The promotion gate as a library (`evaluation.gate`, `gating`, `evalruns`): checks, the best earlier
evaluation of the same target and eval set, the marker, bad input. The flow (a Failed evaluate flow run,
the cache reused after a threshold change) is tests/test_gate_flow.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftflow.config import RunConfig, load_config
from draftflow.config.evaluate import GateConfig
from draftflow.contracts import Manifest, ShardResult, StageResult
from draftflow.errors import ConfigError
from draftflow.evaluation.gate import GateError, GateFailed, decide
from draftflow.promotion import marker_path
from draftflow.runs.gating import apply_gate, check_gate, raise_if_failed
from draftflow.stages.common import finalize
from draftflow.stages.registry import stamp
from draftflow.store import Store, shard_entry

REPORT = {"tau": 2.0, "acceptance_rate": [0.5], "accept_histogram": [0, 1, 1], "steps": 2, "tokens": 4, "prompts": 1}


def test_min_tau_fails_below_and_passes_at_the_threshold():
    bad = decide(REPORT, GateConfig(min_tau=2.5))
    assert not bad["passed"] and bad["checks"] == [
        {"name": "min_tau", "value": 2.0, "threshold": 2.5, "passed": False, "detail": "tau 2.000 < min_tau 2.5"}
    ]
    assert decide(REPORT, GateConfig(min_tau=2.0))["passed"]
    assert decide(REPORT, GateConfig()) == {"passed": True, "checks": [], "notes": []}


def test_min_speedup_reads_the_predicted_speedup_and_is_one_line_when_the_report_has_none():
    fast = REPORT | {"speedup": {"predicted": 1.8, "drafter_setting": "dflash:k=3"}}
    assert decide(fast, GateConfig(min_speedup=1.5))["passed"]
    assert not decide(fast, GateConfig(min_speedup=2.0))["passed"]
    for old in (REPORT, REPORT | {"speedup": None}, REPORT | {"speedup": {"formula": "…"}}):
        with pytest.raises(GateError, match="min_speedup is set but the report has no predicted speedup") as exc:
            decide(old, GateConfig(min_speedup=1.5))
        assert "\n" not in str(exc.value)


def test_max_regression_is_the_fraction_below_the_baseline_and_the_first_run_passes_with_a_note():
    first = decide(REPORT, GateConfig(max_regression=0.1))
    assert first["passed"] and first["checks"][0]["value"] is None and "first" in first["notes"][0]
    base = {"tau": 2.5, "label": "run/abc"}
    worse = decide(REPORT, GateConfig(max_regression=0.1), base)
    assert not worse["passed"] and worse["checks"][0]["value"] == pytest.approx(0.2)
    assert "run/abc's 2.500" in worse["checks"][0]["detail"]
    assert decide(REPORT, GateConfig(max_regression=0.25), base)["passed"]
    assert decide(REPORT, GateConfig(max_regression=0.0), {"tau": 1.5})["checks"][0]["value"] < 0  # it rose


def test_gate_config_bad_values_are_one_line_and_the_gate_is_in_no_fingerprint(tmp_path):
    with pytest.raises(ConfigError, match="evaluate.gate.baseline"):
        load_config(None, ["evaluate.gate.baseline=abc"])  # without max_regression
    with pytest.raises(ConfigError, match="unknown config key 'evaluate.gate.min_taus'"):
        load_config(None, ["evaluate.gate.min_taus=2"])
    with pytest.raises(ConfigError, match="evaluate.gate.max_regression"):
        load_config(None, ["evaluate.gate.max_regression=1.5"])
    plain = load_config(None, [f"root={tmp_path}"])
    gated = load_config(None, [f"root={tmp_path}", "evaluate.gate.min_tau=3", "evaluate.gate.max_regression=0.1"])
    inputs = {"target": "t", "curate": "c", "train": "x"}
    assert stamp(plain, "evaluate", inputs).fingerprint == stamp(gated, "evaluate", inputs).fingerprint


def test_the_gate_code_is_in_no_stage_code_hash():
    """Editing the gate never re-runs a stage: only its config section is reachable from them."""
    from draftflow.codehash import ROOT, closure
    from draftflow.stages.registry import stage_names

    for stage in stage_names():
        names = {str(p.relative_to(ROOT)) for p in closure(ROOT, f"draftflow.stages.{stage}")}
        assert not names & {"evaluation/gate.py", "gating.py", "evalruns.py", "compare.py"}, stage


# ----------------------------------------------------------------------------- in a run root


def evaluation(
    root: Path,
    fp: str,
    tau: float | None,
    target: str = "tiny-a",
    curate: str = "c" * 64,
    num_prompts: int | None = 16,
    **report,
) -> dict:
    """An evaluate stage result written by the stage's own finalize: report.json and the manifest."""
    store = Store(str(root))
    cfg = RunConfig.model_validate({"root": str(root), "evaluate": {"num_prompts": num_prompts}})
    with store.writing(store.stage_path("evaluate", fp, "report.json")) as tmp:
        Path(tmp).write_text(json.dumps(REPORT | {"tau": tau} | report))
        entry = shard_entry("report.json", tmp, rows=0)
    result = ShardResult(shard=entry, rows_in=0, rows_out=0)
    handed = stamp(cfg, "evaluate", {"target": target, "curate": curate, "train": "t" * 64})
    manifest = finalize(store, handed.model_copy(update={"fingerprint": fp}), [result], extra={"tau": tau})
    return _result(manifest)


def _result(manifest: Manifest) -> StageResult:
    return StageResult(stage=manifest.stage, fingerprint=manifest.fingerprint, status="ran", digest="d", path="p",
                       manifest=manifest)


TRAINED = _result(Manifest(stage="train", fingerprint="1111111111111111", code_version="c", config={}, inputs={},
                           shards=(), rows_in=0, rows_out=0, dropped={}, tokens=0))


def gate_cfg(root: Path, **gate) -> RunConfig:
    return RunConfig.model_validate({"root": str(root), "evaluate": {"gate": gate}})


def test_max_regression_compares_with_the_best_earlier_evaluation_of_the_same_target_and_eval_set(tmp_path):
    store = Store(str(tmp_path))
    evaluation(tmp_path, "a" * 16, 2.5)  # comparable
    evaluation(tmp_path, "b" * 16, 2.2)  # comparable, not the best
    evaluation(tmp_path, "c" * 16, 3.9, target="tiny-other")  # another target
    evaluation(tmp_path, "d" * 16, 3.8, num_prompts=8)  # another eval set
    evaluation(tmp_path, "e" * 16, 3.7, curate="d" * 64)  # other eval prompts
    now = evaluation(tmp_path, "f" * 16, 2.0)
    verdict = apply_gate(store, gate_cfg(tmp_path, max_regression=0.1), now, TRAINED)
    assert verdict["baseline"]["label"].endswith("a" * 16) and verdict["checks"][0]["value"] == pytest.approx(0.2)
    assert not verdict["promoted"] and not Path(marker_path(store, TRAINED.stage, TRAINED.fingerprint)).exists()
    assert json.loads((tmp_path / "evaluate" / ("f" * 16) / "gate.json").read_text())["passed"] is False
    with pytest.raises(GateFailed, match=r"tau 2.000 is 20.0% below .*aaaa's 2.500 \(> max_regression 10.0%\)"):
        raise_if_failed(verdict, store)

    verdict = apply_gate(store, gate_cfg(tmp_path, max_regression=0.25, min_tau=1.5), now, TRAINED)
    marker = json.loads(Path(marker_path(store, TRAINED.stage, TRAINED.fingerprint)).read_text())
    assert verdict["promoted"] and marker["promoted"] and marker["evaluate"].endswith("evaluate/" + "f" * 16)
    assert [c["name"] for c in marker["checks"]] == ["min_tau", "max_regression"]
    raise_if_failed(verdict, store)  # passes: nothing raised

    apply_gate(store, gate_cfg(tmp_path, min_tau=2.5), now, TRAINED)  # the last gate failed: no longer promoted
    assert not Path(marker_path(store, TRAINED.stage, TRAINED.fingerprint)).exists()
    assert apply_gate(store, gate_cfg(tmp_path), now, TRAINED) is None  # no threshold: no gate, nothing written


def test_a_named_baseline_is_used_and_a_missing_or_incomparable_one_is_one_line(tmp_path):
    store = Store(str(tmp_path))
    evaluation(tmp_path, "a" * 16, 2.5)
    evaluation(tmp_path, "b" * 16, 1.9)
    other = evaluation(tmp_path, "c" * 16, 3.0, target="tiny-other")
    now = evaluation(tmp_path, "f" * 16, 2.0)
    by_fp = apply_gate(store, gate_cfg(tmp_path, max_regression=0.1, baseline="b" * 16), now, TRAINED)
    assert by_fp["passed"] and by_fp["baseline"]["tau"] == 1.9  # not the best (2.5): the one named
    folder = str(tmp_path / "evaluate" / ("a" * 16))
    for name in (folder, folder + "/report.json"):
        assert (
            apply_gate(store, gate_cfg(tmp_path, max_regression=0.1, baseline=name), now, TRAINED)["baseline"]["tau"]
            == 2.5
        )
    for name, match in (
        ("9" * 16, "no evaluation 9999999999999999 under .*evaluate; name an evaluate fingerprint"),
        (str(tmp_path / "nowhere"), "no evaluation at .*nowhere"),
        (str(tmp_path), "holds 4 evaluations; name one"),
        (other.fingerprint, "measured another target"),
    ):
        cfg = gate_cfg(tmp_path, max_regression=0.1, baseline=name)
        with pytest.raises(GateError, match=match) as exc:
            apply_gate(store, cfg, now, TRAINED)
        assert "\n" not in str(exc.value)
    with pytest.raises(GateError, match="evaluate.gate.baseline=9999999999999999: no evaluation"):
        check_gate(gate_cfg(tmp_path, max_regression=0.1, baseline="9" * 16))  # what preflight calls


def test_min_speedup_on_a_stored_report_without_speedup_is_one_line(tmp_path):
    now = evaluation(tmp_path, "f" * 16, 2.0)
    with pytest.raises(GateError, match=r"min_speedup is set but .*evaluate/f{16} has no predicted speedup"):
        apply_gate(Store(str(tmp_path)), gate_cfg(tmp_path, min_speedup=1.2), now, TRAINED)
    fast = evaluation(tmp_path, "e" * 16, 2.0, speedup={"predicted": 1.5})
    assert apply_gate(Store(str(tmp_path)), gate_cfg(tmp_path, min_speedup=1.2), fast, TRAINED)["promoted"]
