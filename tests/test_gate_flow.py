"""The gate in the DAG, through Prefect: a failing gate fails the evaluate flow run in one line and leaves
the export unpromoted; a changed threshold re-judges the reused evaluation (no decoding); a passing gate
writes the marker and the `<run>-result` artifact says promoted; max_regression against an earlier run
of the same root. Slow tier (the session's Prefect harness and one tiny pipeline run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftflow.evaluation.gate import GateFailed
from draftflow.promotion import PROMOTED
from flows.keys import run_key
from tests.conftest import n_stages, tiny_config


@pytest.fixture(scope="module")
def finished(prefect_harness, tmp_path_factory):
    """A finished tiny run without a gate: its root, summary and evaluate folder."""
    from flows.pipeline import pipeline

    root = tmp_path_factory.mktemp("gate") / "run"
    summary = pipeline(tiny_config(root))
    assert summary["gate"] is None  # no threshold set: no gate, nothing written
    evaluate = Path(next(s["path"] for s in summary["stages"] if s["stage"] == "evaluate"))
    assert not (evaluate / "gate.json").exists()
    return root, summary, evaluate


def _upstream(cfg):
    from draftflow.target import resolve_target
    from flows.pipeline import reused_upstream

    ref = resolve_target(cfg.target)
    target = {"path": ref.path, "fingerprint": ref.fingerprint}
    return target, reused_upstream(cfg, target, "evaluate")


def _mtimes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.name != "gate.json"}


def test_failing_gate_fails_the_flow_then_a_changed_threshold_passes_from_the_cache(finished):
    from prefect.artifacts import Artifact

    from flows.pipeline import pipeline
    from flows.stages import evaluate_flow

    root, summary, evaluate = finished
    tau, before = summary["tau"], _mtimes(evaluate)
    cfg = tiny_config(root, f"evaluate.gate.min_tau={tau + 0.5}")
    target, up = _upstream(cfg)
    state = evaluate_flow(cfg, target, up["curate"], up["train"], return_state=True)
    assert state.is_failed()  # what the Prefect UI shows
    with pytest.raises(GateFailed) as exc:
        state.result()
    line = str(exc.value)
    assert "\n" not in line and f"tau {tau:.3f} < min_tau {tau + 0.5:g}" in line and str(evaluate) in line
    train = Path(up["train"].path)
    assert (train / "export" / "vllm").is_dir() and not (train / "export" / PROMOTED).exists()  # kept, not promoted
    assert json.loads((evaluate / "gate.json").read_text())["promoted"] is False

    passing = tiny_config(root, f"evaluate.gate.min_tau={max(1.0, round(tau - 0.25, 2))}")
    result = evaluate_flow(passing, target, up["curate"], up["train"])
    assert result.status == "reused" and _mtimes(evaluate) == before  # judged again, not decoded again
    assert result.gate["promoted"]
    marker = json.loads((train / "export" / PROMOTED).read_text())
    assert marker["evaluate"] == str(evaluate) and marker["tau"] == tau

    again = pipeline(passing)  # the whole run: every stage reused, the gate applied, the result says so
    assert [s["status"] for s in again["stages"]] == ["reused"] * n_stages() and again["gate"]["promoted"]
    result_md = Artifact.get(f"{run_key(passing)}-result").data
    assert f"promoted: yes (tau {tau:.3f} >= min_tau" in result_md and PROMOTED in result_md

    with pytest.raises(GateFailed, match="min_tau"):
        pipeline(cfg)  # failing again takes the mark away
    assert not (train / "export" / PROMOTED).exists()


def test_max_regression_compares_with_an_earlier_run_in_the_same_root(finished):
    from flows.pipeline import pipeline

    root, summary, evaluate = finished
    cfg = tiny_config(root, "train.max_steps=4", "evaluate.gate.max_regression=0")  # another, shorter training
    state = pipeline(cfg, return_state=True)
    newer = [p for p in (root / "evaluate").iterdir() if p != evaluate]
    assert len(newer) == 1
    verdict = json.loads((newer[0] / "gate.json").read_text())
    tau = json.loads((newer[0] / "report.json").read_text())["tau"]
    check = verdict["checks"][0]
    assert verdict["baseline"]["path"] == str(evaluate) and verdict["baseline"]["tau"] == summary["tau"]
    assert check["name"] == "max_regression" and check["value"] == pytest.approx(1 - tau / summary["tau"])
    assert state.is_failed() == (check["value"] > 0) == (not verdict["promoted"])

    from draftflow.runs.compare import compare  # the same real root, compared: both evaluations, their τ and verdicts

    lines = compare([str(root)]).splitlines()
    assert [line.split()[1] for line in lines[:2]] == [f"run/{evaluate.name}", f"run/{newer[0].name}"]
    taus = next(line for line in lines if line.startswith("tau ")).split()[1:]
    assert taus == [f"{summary['tau']:.3f}", f"{tau:.3f}"]
    assert next(line for line in lines if line.startswith("gate ")).split()[-1] == (
        "promoted" if verdict["promoted"] else "failed"
    )
