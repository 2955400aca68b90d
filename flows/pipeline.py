"""The pipeline flow: every stage of the registry (`draftflow.stages.registry`), in its order (below);
and the per-stage deployment flow, which runs a stage and what it needs.

    sources -> curate -> regenerate -> tokenize -> extract -> train -> evaluate
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.task_runners import ThreadPoolTaskRunner

from draftflow.config import RunConfig
from draftflow.contracts import StageResult
from draftflow.evaluation.serve_choice import advice
from draftflow.export_readme import described_target
from draftflow.report import plots_markdown, without_relative_images
from draftflow.runlock import holding
from draftflow.runs.runinfo import record_run
from draftflow.stages.common import require_rows
from draftflow.stages.registry import downstream_of, maker, needed, registry, spec, stage_gpus
from draftflow.stages.train import EXPORT_FORMATS, serve_lines
from draftflow.store import Store
from draftflow.training.warm import stale_promoted
from flows.common import publish_links
from flows.deploy import gpu_slot
from flows.keys import artifact_key, run_key
from flows.progress import flush as flush_progress
from flows.progress import install as report_progress
from flows.schemas import no_parameter_schema
from flows.signals import note_run, on_crashed
from flows.stages import curate_flow, evaluate_flow, extract_flow, sharded_stage_flow, train_flow
from tasks.stage_tasks import prepare_target


@flow(name="draftflow-pipeline", task_runner=ThreadPoolTaskRunner(max_workers=2), on_crashed=[on_crashed])
@no_parameter_schema
def pipeline(cfg: RunConfig) -> dict:
    """Run (or reuse) every stage, holding the run root's lease; return the stage results and the final figures."""
    note_run()  # interrupted from the CLI: shown Cancelled, with its line (`flows.signals`)
    with holding(cfg.root, cfg.name, cfg.lock.wait_s, cfg.lock.ttl_s):  # one run at a time on a root
        record_run(cfg)
        report_progress(run_key(cfg))
        target = prepare_target(cfg)
        results: dict[str, StageResult] = {}
        log = get_run_logger()
        for stage in registry():  # curate -> regenerate -> tokenize -> extract -> train -> evaluate
            results[stage.name] = run_stage_flow(stage.name, cfg, target, results)
            log_stage(log, results[stage.name])  # in the pipeline run's own logs too (the UI opens there first)
            if downstream_of(stage.name):  # empty: one line naming the stage, not a crash in a later one
                require_rows(results[stage.name].manifest)
        flush_progress()  # each stage's last figures reach the UI (sent from a thread: a lost API never blocks)
    stages = [results[s.name] for s in registry()]
    summary = summarize(cfg, stages, target["path"])
    publish_summary(cfg, summary)
    log.info("mean acceptance length tau = %s%s", _tau(summary["tau"]),
             f"; serve setting: {summary['serve_note']}" if summary.get("serve_note") else "")
    return summary


def log_stage(log, r: StageResult) -> None:
    """A stage's summary line in the calling flow run's logs."""
    log.info("%s %s: %d %s in, %d out, dropped %s -> %s", r.stage, r.status, r.manifest.rows_in, spec(r.stage).unit,
             r.manifest.rows_out, r.manifest.dropped or "nothing", r.path)


def summarize(cfg: RunConfig, stages: list[StageResult], target_path: str) -> dict:
    """The run's figures and where its outputs are (manifests name files relative to their stage folder)."""
    by_name = {s.stage: s for s in stages}
    evaluated, trained = by_name[maker("evaluation")], by_name[maker("drafter")]
    report, extra = evaluated.manifest.extra, trained.manifest.extra
    return {
        "name": cfg.name,
        "target": described_target(cfg.target.path, target_path),  # None unless a converted GGUF target
        "stages": [{"stage": s.stage, "status": s.status, "fingerprint": s.fingerprint, "path": s.path,
                    "rows_in": s.manifest.rows_in, "rows_out": s.manifest.rows_out, "unit": spec(s.stage).unit,
                    "dropped": s.manifest.dropped} for s in stages],
        "tau": report["tau"],
        "gate": evaluated.gate,  # evaluate.gate's verdict, None without one (draftflow.runs.gating)
        "evaluation": report.get("evaluation"),  # tau per category, baselines, predicted speedup
        "checkpoint": f"{trained.path}/{extra['checkpoint']}",
        "exports": {fmt: f"{trained.path}/{rel}" for fmt, rel in _in_export_order(extra.get("export", {}))},
        "serve": serve_lines(Store(cfg.root), trained.manifest, target_path, cfg.target.dtype,  # format -> line
                             cfg.regenerate.vllm, report.get("serve_choice")),
        "serve_note": advice(report.get("serve_choice")),  # what the measured costs chose (None without vLLM)
        "stale": stale_promoted(cfg.root, trained.manifest.inputs.get("target", "")),  # a promoted drafter's target
        "report": f"{evaluated.path}/{report['report']}",
    }


def _in_export_order(exports: dict[str, str]) -> list[tuple[str, str]]:
    """Exports as `train.EXPORT_FORMATS` lists them, on every run (a reused manifest's JSON has its keys sorted)."""
    rank = {fmt: i for i, fmt in enumerate(EXPORT_FORMATS)}
    return sorted(exports.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0]))


def publish_summary(cfg: RunConfig, summary: dict) -> None:
    from draftflow.runs.gating import summary_line

    rows = [{"stage": s["stage"], "status": s["status"], "rows_in": s["rows_in"], "rows_out": s["rows_out"],
             "unit": s["unit"], "dropped": sum(s["dropped"].values()), "path": s["path"]} for s in summary["stages"]]
    create_table_artifact(table=rows, key=artifact_key(run_key(cfg), "pipeline"), description="stages of this run")
    create_markdown_artifact(
        key=artifact_key(run_key(cfg), "result"),
        markdown=f"# {cfg.name}\n\nmean acceptance length **τ = {_tau(summary['tau'])}**\n\n"
                 f"- {summary_line(summary.get('gate'))}\n"
                 + (f"- **promoted drafter is stale**: {summary['stale']}\n" if summary.get("stale") else "")
                 + f"- checkpoint: `{summary['checkpoint']}`\n- report: `{summary['report']}`\n\n"
                 + "".join(f"- export ({fmt}): `{path}`\n\n  ```\n  {summary['serve'].get(fmt, '')}\n  ```\n\n"
                           for fmt, path in summary["exports"].items())
                 + without_relative_images(_read_text(summary["report"])) + "\n"
                 + plots_markdown([s["path"] for s in summary["stages"]]),
    )
    publish_links(cfg, {"checkpoint": summary["checkpoint"], "report": summary["report"]})


def _tau(tau: float | None) -> str:
    return "n/a" if tau is None else f"{tau:.3f}"


def _read_text(url: str) -> str:
    import fsspec

    with fsspec.open(url, "r") as fh:
        return fh.read()


@flow(name="draftflow-pipeline-from-file", on_crashed=[on_crashed])
@no_parameter_schema
def pipeline_from_file(config_path: str, overrides: list[str] | None = None) -> dict:
    """Deployment entry point: load the config on the worker, then run the pipeline."""
    from draftflow.config import load_config
    from draftflow.runs.plan import preflight

    cfg = load_config(config_path, overrides or [])
    preflight(cfg)
    return pipeline(cfg)


# The stages whose work is not one task per input shard have a flow of their own (named as the stage);
# every other stage of the registry runs in the generic sharded flow.
OWN_FLOWS = {f.name: f for f in (curate_flow, extract_flow, train_flow, evaluate_flow)}


def stage_flow(stage: str):
    """The flow of `stage`: its own, or the generic sharded one for a registry stage with `run_shard`."""
    if stage in OWN_FLOWS:
        return OWN_FLOWS[stage]
    if spec(stage).run_shard is None:
        from draftflow.errors import ConfigError

        raise ConfigError(f"stage {stage} has neither a flow nor a run_shard; give its StageSpec a run_shard")
    return sharded_stage_flow(stage)


def run_stage_flow(stage: str, cfg: RunConfig, target: dict, results: dict[str, StageResult]) -> StageResult:
    """Run (or reuse) one stage's flow given its upstream results, in the registry's order. A stage
    whose whole run uses the GPU holds its slots here; shard-level GPU stages take theirs around
    their GPU-tagged shard tasks."""
    from contextlib import nullcontext

    from draftflow import interrupt

    interrupt.entering(stage)  # for the one line of a run stopped here
    s = spec(stage)
    upstream = [results[u] for u in s.upstream]
    with gpu_slot(gpus=stage_gpus(cfg, stage)) if s.gpu == "stage" else nullcontext():
        run = stage_flow(stage)
        return run(cfg, target, *upstream) if s.uses_target else run(cfg, *upstream)


def reused_upstream(cfg: RunConfig, target: dict, stage: str) -> dict[str, StageResult]:
    """The upstream stages of `stage`, all complete in the run root; else a one-line error naming the first missing."""
    from draftflow.errors import DraftflowError
    from draftflow.runs.runinfo import stage_status
    from draftflow.stages.common import stage_result
    from draftflow.store import Store
    from draftflow.target import TargetRef

    status = {s["stage"]: s for s in stage_status(cfg, TargetRef(**target))}
    ups = needed(stage)[:-1]
    missing = [u for u in ups if status[u]["state"] != "complete"]
    if missing:
        raise DraftflowError(
            f"stage {stage} needs {missing[0]} complete under {cfg.root} for this config; run the "
            f"{missing[0]} deployment first, or this one with upstream=run")
    store = Store(cfg.root)
    return {u: stage_result(store, status[u]["manifest"], "reused") for u in ups}


@flow(name="draftflow-stage", task_runner=ThreadPoolTaskRunner(max_workers=2), on_crashed=[on_crashed])
@no_parameter_schema
def stage_from_file(config_path: str, stage: str, overrides: list[str] | None = None,
                    upstream: str = "reuse") -> StageResult:
    """Deployment entry point for one stage.

    upstream="reuse": the stages it needs must be complete in the run root (found by fingerprint, never
    re-run: a CPU pool never starts a GPU stage); "run": run or reuse them first, in order (the
    pipeline up to `stage`). Returns the stage's result (status, fingerprint, path, manifest).
    """
    from draftflow.config import load_config
    from draftflow.errors import ConfigError
    from draftflow.runs.plan import preflight
    from draftflow.stages.registry import stage_names

    if stage not in stage_names() or upstream not in ("reuse", "run"):
        raise ConfigError(f"stage must be one of {', '.join(stage_names())} and upstream reuse or run; "
                          f"got stage={stage!r} upstream={upstream!r}")
    cfg = load_config(config_path, overrides or [])
    preflight(cfg)
    with holding(cfg.root, cfg.name, cfg.lock.wait_s, cfg.lock.ttl_s):
        record_run(cfg)
        report_progress(run_key(cfg))
        target = prepare_target(cfg)
        results = {} if upstream == "run" else reused_upstream(cfg, target, stage)
        for s in needed(stage) if upstream == "run" else [stage]:
            results[s] = run_stage_flow(s, cfg, target, results)
            if s != stage:
                require_rows(results[s].manifest)
    return results[stage]
