"""The promotion gate: checks of one evaluation's report against `evaluate.gate`'s thresholds.

`decide(report, gate, baseline)` turns a report.json dict (the evaluate stage's) into a verdict:
one check per threshold set, each with the measured value, the threshold and whether it passed.
`failure_line(verdict)` is the one line a failing gate stops the run with.

What it does not know: stores, manifests, run roots, Prefect. Finding the best earlier evaluation
(`max_regression`) and writing the `promoted` marker are `draftflow.runs.gating`'s; this module gets
the baseline's τ already chosen. Trade-off: a report without a value a threshold needs (a
`min_speedup` on a report with no predicted speedup) is an error, not a pass: a gate that
silently skips a check would promote what it never measured.
"""

from __future__ import annotations

from typing import Any

from draftflow.config.evaluate import GateConfig
from draftflow.errors import DraftflowError


class GateError(DraftflowError):
    """The gate cannot be applied: a value it needs is missing, or its baseline cannot be found."""


class GateFailed(DraftflowError):
    """A threshold of `evaluate.gate` is not met: the drafter is not promoted."""


def measured_tau(report: dict[str, Any]) -> float | None:
    """The report's overall mean acceptance length (None: no drafting step was measured)."""
    tau = report.get("tau")
    return None if tau is None else float(tau)


def measured_speedup(report: dict[str, Any]) -> float | None:
    """The report's predicted speedup of the drafter at its best setting (`speedup.predicted`), or None when the
    report has none.

    Read defensively: reports written before the speedup was measured have no `speedup` key.
    """
    speed = report.get("speedup")
    value = speed.get("predicted") if isinstance(speed, dict) else None
    return None if value is None else float(value)


def _check(name: str, value: float | None, threshold: float, passed: bool, detail: str) -> dict[str, Any]:
    return {"name": name, "value": value, "threshold": threshold, "passed": passed, "detail": detail}


def _need_tau(report: dict[str, Any], setting: str, where: str) -> float:
    tau = measured_tau(report)
    if tau is None:
        raise GateError(
            f"evaluate.gate.{setting} is set but {where} has no tau (no drafting step was measured); "
            "evaluate more prompts (evaluate.num_prompts, evaluate.max_new_tokens) or unset it"
        )
    return tau


def decide(
    report: dict[str, Any], gate: GateConfig, baseline: dict[str, Any] | None = None, where: str = "the report"
) -> dict[str, Any]:
    """The gate's verdict on one evaluation.

    Args:
        report: the evaluate stage's report.json (at least `tau`; `speedup.predicted` for min_speedup).
        gate: the thresholds; each one set is a check.
        baseline: for max_regression, `{"tau", "label", "categories"}` of the evaluation to compare with (the best
            earlier one of the same target and eval set, or `gate.baseline`); None: there is none,
            so the check passes with a note (a first run has nothing to regress against).
        where: how messages name the evaluation (e.g. its folder).

    Returns:
        `{"passed", "checks": [{"name", "value", "threshold", "passed", "detail"}], "notes"}`; a
        regression's value is the fraction τ fell below the baseline's (negative: it rose).

    Raises:
        GateError: a threshold needs a value the report does not have.
    """
    checks, notes = [], []
    if gate.min_tau is not None:
        tau = _need_tau(report, "min_tau", where)
        checks.append(
            _check(
                "min_tau",
                tau,
                gate.min_tau,
                tau >= gate.min_tau,
                f"tau {tau:.3f} {'>=' if tau >= gate.min_tau else '<'} min_tau {gate.min_tau:g}",
            )
        )
    if gate.min_speedup is not None:
        speed = measured_speedup(report)
        if speed is None:
            raise GateError(
                f"evaluate.gate.min_speedup is set but {where} has no predicted speedup "
                "(report.json speedup.predicted); unset min_speedup or re-evaluate with a draftflow "
                "that measures it"
            )
        ok = speed >= gate.min_speedup
        checks.append(
            _check(
                "min_speedup",
                speed,
                gate.min_speedup,
                ok,
                f"predicted speedup {speed:.2f} {'>=' if ok else '<'} min_speedup {gate.min_speedup:g}",
            )
        )
    if gate.max_regression is not None:
        tau = _need_tau(report, "max_regression", where)
        best = None if baseline is None else baseline.get("tau")
        if best is None:
            notes.append(
                "max_regression: no earlier evaluation of the same target and eval set to compare "
                "with; passed (this is the first)"
            )
            checks.append(_check("max_regression", None, gate.max_regression, True, "nothing to regress against"))
        else:
            drop = 1.0 - tau / float(best)
            ok = drop <= gate.max_regression
            checks.append(
                _check(
                    "max_regression",
                    drop,
                    gate.max_regression,
                    ok,
                    f"tau {tau:.3f} is {_relative(drop)} {baseline.get('label', 'the baseline')}'s {float(best):.3f} "
                    f"({'<=' if ok else '>'} max_regression {gate.max_regression:.1%})",
                )
            )
            if gate.max_category_regression is not None:
                checks.append(_category_check(report, baseline, gate.max_category_regression))
    return {"passed": all(c["passed"] for c in checks), "checks": checks, "notes": notes}


def _relative(drop: float) -> str:
    return f"{drop:.1%} below" if drop >= 0 else f"{-drop:.1%} above"


def _category_check(report: dict[str, Any], baseline: dict[str, Any], limit: float) -> dict[str, Any]:
    """The category that fell most below the baseline's tau on it (categories both measured), against `limit`."""
    ours, theirs = report.get("categories") or {}, baseline.get("categories") or {}
    drops = {c: 1.0 - ours[c]["tau"] / theirs[c] for c in sorted(set(ours) & set(theirs))
             if ours[c].get("tau") is not None and theirs[c]}
    if not drops:
        return _check("max_category_regression", None, limit, True, "no category measured by both")
    worst = max(drops, key=drops.get)
    ok = drops[worst] <= limit
    return _check("max_category_regression", drops[worst], limit, ok,
                  f"category {worst}: tau {ours[worst]['tau']:.3f} is {_relative(drops[worst])} the baseline's "
                  f"{theirs[worst]:.3f} ({'<=' if ok else '>'} max_category_regression {limit:.1%})")


def failure_line(verdict: dict[str, Any], where: str) -> str:
    """The one line a failing gate stops the run with: every failed check's value and threshold."""
    failed = "; ".join(c["detail"] for c in verdict["checks"] if not c["passed"])
    return (
        f"evaluate gate failed for {where}: {failed}; the export is kept but not promoted "
        "(change the drafter or evaluate.gate, then re-run: the evaluation is reused)"
    )
