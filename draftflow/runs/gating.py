"""Apply `evaluate.gate` to a complete evaluate stage: find what it regresses against, record the
verdict, and mark the drafter's export promoted (or take the mark away).

The gate runs after the evaluate stage, also when the stage is reused from the store: its
thresholds are in no fingerprint, so a changed threshold re-judges the same measurement without
decoding again. It writes three small files outside the stages' manifests (no manifest lists them,
so no sha256 contract covers or breaks on them):

- `<root>/evaluate/<fp>/gate.json`: the last verdict on that evaluation (checks, notes, baseline);
- `<root>/train/<fp>/export/promoted.json`: present while the last gate applied to that export
  passed (which evaluation promoted it, its τ and checks); a failing gate removes it. Deployment
  scripts test for this file; the export folders themselves are never touched.
- `<root>/promoted.json` (`draftflow.promotion.record_promotion`): the drafter in service and every one promoted
  before it, each with its evaluation, τ and target fingerprint.

What it does not know: Prefect (the evaluate flow publishes the verdict and fails the flow run).
Trade-off: "best earlier" is the highest τ among the other complete evaluations of the same target
and eval set in this root (`draftflow.runs.evalruns`), gated or not, whatever drafter kind: the bar is
what was measured, not what was shipped.
"""

from __future__ import annotations

import os
import re
from typing import Any

from draftflow.config import RunConfig
from draftflow.config.evaluate import GateConfig
from draftflow.contracts import StageResult
from draftflow.errors import DraftflowError
from draftflow.evaluation.gate import GateError, GateFailed, decide, failure_line
from draftflow.promotion import marker_path, record_promotion
from draftflow.runs.evalruns import (
    GATE,
    REPORT,
    Evaluation,
    eval_set_key,
    evaluate_stage,
    in_root,
    load,
    of_result,
    resolve,
)
from draftflow.store import Store

FINGERPRINT = re.compile(r"^[0-9a-f]{16}$")


def named_baseline(store: Store, gate: GateConfig) -> Evaluation:
    """The evaluation `gate.baseline` names: an evaluate fingerprint of this root, an evaluate folder
    or a report.json.

    Raises:
        GateError: nothing is there, or a run root holding several evaluations (one line).
    """
    name = gate.baseline
    found = load(store, name) if FINGERPRINT.match(name or "") else None
    if found is not None and found.manifest is not None:
        found.eval_set = eval_set_key(store, found.manifest)
    if found is None and FINGERPRINT.match(name or "") and not os.path.exists(name):
        raise GateError(
            f"evaluate.gate.baseline={name}: no evaluation {name} under {store.url(store.path(evaluate_stage()))}; "
            "name an evaluate fingerprint of this root, an evaluate folder or a report.json"
        )
    if found is None:
        try:
            evs = resolve(name)
        except (DraftflowError, OSError) as exc:
            raise GateError(f"evaluate.gate.baseline={name}: {exc}".split("\n")[0]) from None
        if len(evs) != 1:
            raise GateError(
                f"evaluate.gate.baseline={name} holds {len(evs)} evaluations; name one: its fingerprint "
                "or its evaluate folder"
            )
        found = evs[0]
    if found.tau is None:
        raise GateError(f"evaluate.gate.baseline={name} has no tau to regress against; name another evaluation")
    return found


def check_gate(cfg: RunConfig) -> None:
    """Preflight: a named baseline exists (before any work). Raises GateError in one line."""
    if cfg.evaluate.gate.baseline is not None:
        named_baseline(Store(cfg.root), cfg.evaluate.gate)


def baseline_for(store: Store, gate: GateConfig, this: Evaluation) -> dict[str, Any] | None:
    """`{"tau", "label", "path"}` of what `this` regresses against: `gate.baseline`, else the best earlier
    evaluation of the same target and eval set in the root; None when there is none.

    Raises:
        GateError: the named baseline is missing, or measured another target or eval set.
    """
    if gate.baseline is not None:
        base = named_baseline(store, gate)
        if base.manifest is not None and (base.target != this.target or base.eval_set != this.eval_set):
            what = "target" if base.target != this.target else "eval set (prompts, num_prompts, max_new_tokens)"
            raise GateError(
                f"evaluate.gate.baseline={gate.baseline} measured another {what} than {this.path}; "
                "a regression between them means nothing: name an evaluation of the same"
            )
        return {"tau": base.tau, "label": base.label, "path": base.path, "categories": _category_taus(base)}
    same = [
        e
        for e in in_root(store, with_eval_set=True)
        if e.fingerprint != this.fingerprint
        and e.manifest is not None
        and e.tau is not None
        and e.target == this.target
        and e.eval_set == this.eval_set
    ]
    if not same:
        return None
    best = max(same, key=lambda e: e.tau)
    return {"tau": best.tau, "label": best.label, "path": best.path, "categories": _category_taus(best)}


def _category_taus(e: Evaluation) -> dict[str, float]:
    """tau per eval category of an evaluation's report (for max_category_regression)."""
    return {c: v["tau"] for c, v in (e.report.get("categories") or {}).items() if v.get("tau") is not None}


def apply_gate(
    store: Store, cfg: RunConfig, evaluated: StageResult, trained: StageResult
) -> dict[str, Any] | None:
    """Judge a complete evaluate stage by `cfg.evaluate.gate`; record the verdict and set or clear the marker.

    Args:
        evaluated, trained: the evaluate and train stage results (fingerprint, manifest).

    Returns:
        None when no threshold is set (nothing written); else the verdict (`evaluation.gate.decide`)
        plus `evaluate` (its fingerprint), `baseline`, `promoted` and `marker` (the marker's URL or None).

    Raises:
        GateError: a value a threshold needs is missing, or the baseline cannot be used.
    """
    gate = cfg.evaluate.gate
    if not gate.active:
        return None
    fp = evaluated.fingerprint
    this = of_result(store, evaluated)
    if this is None:
        raise GateError(f"evaluate/{fp} has no {REPORT}; re-run the evaluate stage")
    this.eval_set = eval_set_key(store, this.manifest) if this.manifest else None
    baseline = baseline_for(store, gate, this) if gate.max_regression is not None else None
    verdict = decide(this.report, gate, baseline, where=this.path)
    marker = marker_path(store, trained.stage, trained.fingerprint)
    verdict |= {
        "evaluate": fp,
        "evaluate_path": store.url(store.stage_path(evaluated.stage, fp)),
        "baseline": baseline,
        "promoted": verdict["passed"],
        "marker": store.url(marker) if verdict["passed"] else None,
    }
    store.write_json(store.stage_path(evaluated.stage, fp, GATE), verdict)
    if verdict["passed"]:
        store.write_json(
            marker,
            {
                "promoted": True,
                "run": cfg.name,
                "evaluate": this.path,
                "tau": this.tau,
                "checks": verdict["checks"],
                "notes": verdict["notes"],
            },
        )
        record_promotion(store, trained.stage, trained.fingerprint, run=cfg.name, evaluate=fp, tau=this.tau,
                         target=trained.manifest.inputs.get("target"))
    elif store.exists(marker):
        store.fs.rm(marker)
    return verdict


def raise_if_failed(verdict: dict[str, Any] | None, store: Store) -> None:
    """Stop with one line when the gate failed (GateFailed names each measured value and threshold)."""
    if verdict is not None and not verdict["passed"]:
        raise GateFailed(failure_line(verdict, verdict["evaluate_path"]))


def summary_line(verdict: dict[str, Any] | None) -> str:
    """How the run's result names the gate's decision, in one line."""
    if verdict is None:
        return "gate: none configured (evaluate.gate), nothing promoted"
    checks = "; ".join(c["detail"] for c in verdict["checks"])
    if verdict["promoted"]:
        return f"promoted: yes ({checks}); marker {verdict['marker']}"
    return f"promoted: no ({checks})"
