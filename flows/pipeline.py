"""The pipeline flow: one call per stage, as in the ARCHITECTURE.md diagram.

    sources -> curate -> regenerate -> tokenize -> extract -> train -> evaluate
"""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.task_runners import ThreadPoolTaskRunner

from draftflow.config import RunConfig
from draftflow.runinfo import record_run
from flows.common import artifact_key
from flows.stages import curate_flow, evaluate_flow, extract_flow, regenerate_flow, tokenize_flow, train_flow
from tasks.stage_tasks import prepare_target


@flow(name="draftflow-pipeline", task_runner=ThreadPoolTaskRunner(max_workers=2))
def pipeline(cfg: RunConfig) -> dict:
    """Run (or reuse) every stage; return the stage results and the final figures."""
    record_run(cfg)
    target = prepare_target(cfg)
    curated = curate_flow(cfg)
    regenerated = regenerate_flow(cfg, target, curated)
    tokenized = tokenize_flow(cfg, target, regenerated)
    features = extract_flow(cfg, target, tokenized)
    trained = train_flow(cfg, target, features)
    evaluated = evaluate_flow(cfg, target, curated, trained)
    stages = [curated, regenerated, tokenized, features, trained, evaluated]
    summary = summarize(cfg, stages)
    publish_summary(cfg, summary)
    return summary


def summarize(cfg: RunConfig, stages: list[dict]) -> dict:
    report = stages[-1]["manifest"]["extra"]
    return {
        "name": cfg.name,
        "stages": [{k: s[k] for k in ("stage", "status", "fingerprint", "path")} |
                   {"rows_in": s["manifest"]["rows_in"], "rows_out": s["manifest"]["rows_out"],
                    "dropped": s["manifest"]["dropped"]} for s in stages],
        "tau": report["tau"],
        "checkpoint": stages[-2]["manifest"]["extra"]["checkpoint"],
        "report": report["report"],
    }


def publish_summary(cfg: RunConfig, summary: dict) -> None:
    rows = [{"stage": s["stage"], "status": s["status"], "rows_in": s["rows_in"], "rows_out": s["rows_out"],
             "dropped": sum(s["dropped"].values()), "path": s["path"]} for s in summary["stages"]]
    create_table_artifact(table=rows, key=artifact_key(cfg.name, "pipeline"), description="stages of this run")
    create_markdown_artifact(
        key=artifact_key(cfg.name, "result"),
        markdown=f"# {cfg.name}\n\nmean acceptance length **τ = {summary['tau']}**\n\n"
                 f"- checkpoint: `{summary['checkpoint']}`\n- report: `{summary['report']}`\n",
    )


@flow(name="draftflow-pipeline-from-file")
def pipeline_from_file(config_path: str, overrides: list[str] | None = None) -> dict:
    """Deployment entry point: load the config on the worker, then run the pipeline."""
    from draftflow.config import load_config
    from draftflow.plan import preflight

    cfg = load_config(config_path, overrides or [])
    preflight(cfg)
    return pipeline(cfg)
