"""The refresh flow: keep a root's drafter fresh on the traffic it serves (`draftflow refresh`, and the scheduled
`refresh` deployment in deployments/prefect.yaml).

    new log files -> batch n (watermark) -> curate (+ every batch's rows, batch n's held-out slice as `recent`)
      -> regenerate (only rows no earlier stage answered) -> tokenize -> extract
      -> train, warm-started from the promoted drafter -> evaluate the candidate and the promoted drafter
      on the same prompts -> the gate (evaluate.gate, plus: no more than refresh.max_regression below the
      promoted drafter) -> promoted or not -> one line of refresh/history.json

A refresh with no new log file does nothing and says so. One that was killed resumes its batch: its stages come
from the cache and train from its checkpoint. The root's lease (`draftflow.runlock`) makes a second refresh wait
or stop in one line, so the watermark has one writer.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.task_runners import ThreadPoolTaskRunner

from draftflow.config import RunConfig, validate_config
from draftflow.contracts import StageResult
from draftflow.promotion import export_stage, promoted_export
from draftflow.refresh import history
from draftflow.refresh.batches import Batch, sources_for, take_batch
from draftflow.refresh.preflight import check_refresh
from draftflow.runlock import holding
from draftflow.runs.evalruns import load
from draftflow.runs.gating import apply_gate
from draftflow.runs.runinfo import record_run
from draftflow.stages.common import require_rows, stage_result
from draftflow.stages.registry import downstream_of, maker, registry
from draftflow.store import Store
from flows.common import publish_table
from flows.keys import artifact_key, run_key
from flows.pipeline import log_stage, publish_summary, run_stage_flow, summarize
from flows.progress import flush as flush_progress
from flows.progress import install as report_progress
from flows.schemas import no_parameter_schema
from flows.signals import note_run, on_crashed
from tasks.stage_tasks import prepare_target


def candidate_config(cfg: RunConfig, store: Store, batch: Batch, warm: bool) -> RunConfig:
    """The run config of a refresh on `batch`: the batch's sources added, the held-out category evaluated, and (with
    a promoted drafter) train warm-started from it for `refresh.warm_steps` of its steps at `refresh.warm_lr` of its
    learning rate."""
    data = cfg.model_dump(mode="json", exclude_unset=False)
    data["curate"]["sources"] = [*data["curate"]["sources"], *sources_for(store, batch, cfg.refresh.category)]
    categories = data["evaluate"].get("categories")
    if batch.held_out and isinstance(categories, list) and cfg.refresh.category not in categories:
        data["evaluate"]["categories"] = [*categories, cfg.refresh.category]
    if warm and not cfg.train.init_from:
        data["train"]["init_from"] = "promoted"
        if cfg.refresh.warm_steps is not None:
            data["train"]["max_steps"] = max(1, math.ceil(cfg.train.max_steps * cfg.refresh.warm_steps))
        if cfg.refresh.warm_lr is not None:
            data["train"]["lr"] = cfg.train.lr * cfg.refresh.warm_lr
    data["evaluate"]["gate"] = {}  # applied by the refresh itself, against the promoted drafter (`_gated`)
    return validate_config(data, f"refresh batch {batch.n}")


def _gated(cfg: RunConfig, run_cfg: RunConfig, live_eval: str | None) -> RunConfig:
    """The gate a candidate must pass: the config's thresholds, and at most `refresh.max_regression` below the
    promoted drafter's tau on the same prompts (its evaluation `live_eval`; none: the best earlier one), in all and
    (`refresh.max_category_regression`) in each category."""
    gate = cfg.evaluate.gate.model_dump() | {"max_regression": cfg.refresh.max_regression, "baseline": live_eval,
                                             "max_category_regression": cfg.refresh.max_category_regression}
    return run_cfg.model_copy(update={"evaluate": run_cfg.evaluate.model_copy(update={
        "gate": type(cfg.evaluate.gate).model_validate(gate)})})


@flow(name="draftflow-refresh", task_runner=ThreadPoolTaskRunner(max_workers=2), on_crashed=[on_crashed])
@no_parameter_schema
def refresh(cfg: RunConfig) -> dict:
    """One refresh of `cfg.root` on the traffic under `cfg.refresh.traffic`; returns what it decided."""
    log, store = get_run_logger(), Store(cfg.root)
    note_run()  # interrupted from the CLI: shown Cancelled, with its line (`flows.signals`)
    with holding(cfg.root, cfg.name, cfg.lock.wait_s, cfg.lock.ttl_s):  # one writer of the watermark
        batch, resumed = take_batch(store, cfg.refresh, history.finished(store))
        if batch is None:
            line = f"no new traffic under {cfg.refresh.traffic}: nothing to refresh"
            log.info(line)
            return {"nothing": line}
        if batch.rows < cfg.refresh.min_rows:
            return _record(cfg, store, batch, None, None, False,
                           f"only {batch.rows} new conversations to train on (refresh.min_rows "
                           f"{cfg.refresh.min_rows}), "
                           f"rejected {batch.rejected or 'none'}")
        log.info("refresh on traffic batch %d%s: %d new conversations (%d held out as %r), rejected %s", batch.n,
                 " (resumed)" if resumed else "", batch.new_rows, batch.held_out, cfg.refresh.category,
                 batch.rejected or "none")
        live = promoted_export(store)
        run_cfg = candidate_config(cfg, store, batch, warm=live is not None)
        record_run(run_cfg)
        report_progress(run_key(run_cfg))
        target = prepare_target(run_cfg)
        results: dict[str, StageResult] = {}
        evaluate, train = maker("evaluation"), maker("drafter")
        for stage in registry():
            if stage.name == evaluate:
                break
            results[stage.name] = run_stage_flow(stage.name, run_cfg, target, results)
            log_stage(log, results[stage.name])
            if downstream_of(stage.name):
                require_rows(results[stage.name].manifest)
        live_eval = _evaluate_live(run_cfg, store, target, results, live)
        results[evaluate] = run_stage_flow(evaluate, run_cfg, target, results)
        log_stage(log, results[evaluate])
        verdict = apply_gate(store, _gated(cfg, run_cfg, live_eval), results[evaluate], results[train])
        publish_table(run_cfg, evaluate, "gate", verdict["checks"], "refresh gate: measured value, threshold, passed")
        results[evaluate] = results[evaluate].model_copy(update={"gate": verdict})
        flush_progress()
    summary = summarize(run_cfg, [results[s.name] for s in registry()], target["path"])
    publish_summary(run_cfg, summary)
    live_tau = load(store, live_eval).tau if live_eval else None
    return summary | _record(cfg, store, batch, summary, live_tau, verdict["passed"], _reason(verdict))


def _evaluate_live(run_cfg: RunConfig, store: Store, target: dict, results: dict[str, StageResult],
                   live: tuple[str, str] | None) -> str | None:
    """Evaluate the promoted drafter on the candidate's prompts; its evaluate fingerprint, or None when nothing is
    promoted (or the candidate is that drafter: a refresh that promoted, then was killed before its history line)."""
    train = maker("drafter")
    if live is None or live[0] == results[train].fingerprint:
        return None
    manifest = store.read_manifest(export_stage(live[1]), live[0])
    if manifest is None:
        get_run_logger().warning("the promoted drafter's train stage (%s) is incomplete; the candidate is "
                                 "judged without it", live[1])
        return None
    trained = stage_result(store, manifest, "reused")
    return run_stage_flow(maker("evaluation"), run_cfg, target, {**results, train: trained}).fingerprint


def _reason(verdict: dict) -> str:
    """Why: the checks that failed, else every check (each names its measured value and threshold)."""
    failed = [c["detail"] for c in verdict["checks"] if not c["passed"]]
    if not failed and verdict.get("baseline") is None:
        return "the first drafter of this root (nothing to regress against)"
    return "; ".join(failed or [c["detail"] for c in verdict["checks"]])


def _record(cfg: RunConfig, store: Store, batch: Batch, summary: dict | None, live_tau: float | None,
            promoted: bool, reason: str) -> dict:
    """Write the refresh's history line; publish the tau-history document; return the line."""
    stages = {s["stage"]: s["fingerprint"] for s in (summary or {}).get("stages", [])}
    entry = {"batch": batch.n, "at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
             "new_rows": batch.new_rows, "tau": (summary or {}).get("tau"), "live_tau": live_tau,
             "promoted": promoted, "reason": reason, "train": stages.get(maker("drafter")),
             "evaluate": stages.get(maker("evaluation")),
             "rejected": batch.rejected}
    done = history.record(store, entry)
    line = history.line(done[-1])
    get_run_logger().info(line)
    create_markdown_artifact(markdown=history.markdown(done), key=artifact_key(run_key(cfg), "refreshes"),
                             description=f"{cfg.name}: tau of each refresh's candidate and of the live drafter")
    return {"history": line, "promoted": promoted}


@flow(name="draftflow-refresh-from-file", on_crashed=[on_crashed])
@no_parameter_schema
def refresh_from_file(config_path: str, overrides: list[str] | None = None, traffic: str | None = None) -> dict:
    """Deployment entry point: load the config on the worker (`traffic` overrides refresh.traffic), then refresh."""
    from draftflow.config import load_config
    from draftflow.runs.plan import preflight

    cfg = load_config(config_path, [*(overrides or []), *([f"refresh.traffic={traffic}"] if traffic else [])])
    preflight(cfg)
    check_refresh(cfg)
    result = refresh(cfg)
    get_run_logger().info(result.get("nothing") or result["history"])  # the decision, where the deployment's run is
    return result
