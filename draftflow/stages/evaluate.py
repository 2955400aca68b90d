"""Evaluate stage: speculative decoding with target + drafter on the eval prompts.

Acceptance is measured by decoding, not by training accuracy (high training
accuracy with low served acceptance is a known failure). The decoded tokens
must equal the target's own greedy output, else the stage fails. Writes
`report.json` and `report.md` beside the manifest.

With `evaluate.engine=vllm` both exports of the trained drafter (vLLM-native and
speculators) are also served by vLLM's speculative decoding on the same prompts
(`draftflow.engines.vllm_serve`): their tokens must equal greedy, and vLLM's τ must be
within `evaluate.vllm_tau_tolerance` of draftflow's, else the stage fails with
one line: the drafter would serve differently from how it was measured.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from draftflow import progress
from draftflow.config import EvaluateConfig, RunConfig
from draftflow.contracts import Manifest, ShardEntry, ShardResult, StageResult, Stamp
from draftflow.data.schema import read_rows, template_kwargs
from draftflow.drafters.registry import drafter_spec, spec_for_architecture
from draftflow.engines.vllm_serve import ServeJob
from draftflow.errors import ConfigError, DraftflowError, LosslessError
from draftflow.evaluation.alignment import alignment_line, alignment_report
from draftflow.evaluation.compare_with import OtherDrafter, decode_others, resolve_all, rounding_for
from draftflow.evaluation.ddtree import ddtree_taus, evaluate_ddtree, plot_ddtree, render_ddtree
from draftflow.evaluation.selection import prompt_set
from draftflow.evaluation.served import render as render_served
from draftflow.evaluation.suite import add_comparisons, proposer_taus
from draftflow.evaluation.summary import draw_plots, headline
from draftflow.evaluation.summary import markdown as evaluation_markdown
from draftflow.export_readme import described_target
from draftflow.features import round_trip
from draftflow.small_rows import use_small_rows
from draftflow.stages.common import finalize
from draftflow.store import Store, shard_entry
from draftflow.target import TargetRef, eos_token_ids, load_target

log = logging.getLogger(__name__)
STAGE = "evaluate"


def first_prompt(messages: list[dict]) -> list[dict]:
    """The conversation up to and including its first user turn (system prompts kept)."""
    out = []
    for m in messages:
        out.append({"role": m["role"], "content": m["content"]})
        if m["role"] == "user":
            return out
    return out


def eval_rows(store: Store, curated: StageResult) -> list[dict[str, Any]]:
    """Curate's eval split, in its (shuffled) order; checksums verified."""
    rows = []
    for shard in curated.manifest.data_shards("eval"):
        rows += read_rows(store.verify_sha(curated.stage, curated.fingerprint, shard))
    if not rows:
        raise ConfigError("no eval prompts: set curate.eval_fraction above 0, or `split: eval` on a curate source, "
                          "so curate keeps an eval split")
    return rows


def eval_set(store: Store, curated: StageResult, chat, enable_thinking: bool,
             ecfg: EvaluateConfig | None = None) -> tuple[list[list[int]], list[str], int, list[str]]:
    """(prompt ids, their categories, eval rows in all, their sample ids): the prompts `ecfg` selects
    (`evaluate.categories`, then `num_prompts` round-robin over categories: `draftflow.evaluation.selection.select`);
    all without `ecfg`.

    Raises:
        ConfigError: no eval split, or a category in `evaluate.categories` that no eval prompt has.
    """
    from draftflow.evaluation.selection import row_category, select

    rows = eval_rows(store, curated)
    cats = [row_category(r) for r in rows]
    chosen = select(cats, ecfg.categories, ecfg.num_prompts) if ecfg else list(range(len(rows)))
    prompts = [chat.prompt_ids(first_prompt(rows[i]["messages"]), **template_kwargs(rows[i], enable_thinking))
               for i in chosen]
    return prompts, [cats[i] for i in chosen], len(rows), [rows[i]["sample_id"] for i in chosen]


def eval_prompts(store: Store, curated: StageResult, chat, enable_thinking: bool,
                 ecfg: EvaluateConfig | None = None) -> list[list[int]]:
    """The prompt ids of `eval_set`."""
    return eval_set(store, curated, chat, enable_thinking, ecfg)[0]


def load_drafter(store: Store, trained: StageResult, model):
    """The trained drafter around the target's shared embedding and head (checksums verified)."""
    with tempfile.TemporaryDirectory(prefix="draftflow-drafter-") as folder:
        for s in trained.manifest.shards:
            local = store.verify_sha(trained.stage, trained.fingerprint, s)
            (Path(folder) / Path(s.name).name).write_bytes(Path(local).read_bytes())
        arch = json.loads((Path(folder) / "config.json").read_text()).get("architecture")
        return use_small_rows(spec_for_architecture(arch).model.load(folder, model))


def load_other(other: OtherDrafter, model, default_dtype: str) -> tuple[OtherDrafter, Any, Any]:
    """An `evaluate.compare_with` drafter loaded around the target, with the feature rounding it trained with."""
    if other.folder is not None:
        from draftflow.drafters.registry import load_exported

        drafter = use_small_rows(load_exported(other.folder, model))
    else:
        store = Store(other.root)
        manifest = store.read_manifest(other.stage, other.fingerprint)
        if manifest is None:
            raise ConfigError(f"evaluate.compare_with: {other.name} is no longer complete; re-run its train stage")
        trained = StageResult(stage=other.stage, fingerprint=other.fingerprint, status="reused", digest=other.digest,
                              path=store.url(store.stage_path(other.stage, other.fingerprint)), manifest=manifest)
        drafter = load_drafter(store, trained, model)
    return other, drafter, rounding_for(other, drafter, default_dtype)


class ServingMismatch(DraftflowError):
    """vLLM serving the export measured a different acceptance than draftflow's own decoding."""


def _tau(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def render_report(stats: dict[str, Any], cfg: RunConfig) -> str:
    lines = [f"# {cfg.name}: drafter evaluation", "",
             f"- mean acceptance length **τ = {_tau(stats['tau'])}** over {stats['steps']} steps, "
             f"{stats['prompts']} prompts, {stats['tokens']} tokens (lossless: yes)",
             f"- {_drafting(cfg)}, max new tokens {cfg.evaluate.max_new_tokens}",
             *([f"- training's held-out estimate (teacher-forced, held-out training sequences): τ "
                f"{_tau(stats['heldout_tau'])}, {stats['heldout_tau'] / stats['tau']:.2f}x the decoded τ here"]
               if stats.get("heldout_tau") and stats.get("tau") else []),
             *([f"- target: {stats['target']}"] if stats.get("target") else []), "",
             "| k | P(at least k drafts accepted) |", "|---|---|"]
    lines += [f"| {k} | {r:.3f} |" for k, r in enumerate(stats["acceptance_rate"] or [], 1)]
    if line := alignment_line(stats.get("alignment")):
        lines += ["", line]
    elif "alignment" in stats:  # EAGLE-3 drafts a chain, one token per step: no slots to align
        lines += ["", f"- slot alignment: not measured for {drafter_spec(cfg.drafter.kind).title} (no block slots)"]
    if stats.get("vllm"):
        lines += ["", f"## Served by vLLM (same prompts; tolerance ±{cfg.evaluate.vllm_tau_tolerance:g})", "",
                  "| export | τ vLLM | τ draftflow | drafting steps | lossless |", "|---|---|---|---|---|"]
        lines += [f"| {fmt} | {_tau(r['tau'])} | {_tau(stats['tau'])} | {r['drafts']} | yes |"
                  for fmt, r in stats["vllm"].items()]
    if stats.get("served"):  # tokens/s with and without each method, measured in vLLM
        lines += ["", *render_served(stats["served"], proposer_taus(stats, cfg.drafter.kind))]
    if "categories" in stats:  # categories, baselines, predicted speedup and their plots
        lines += ["", evaluation_markdown(stats, drafter_spec(cfg.drafter.kind).title).rstrip()]
    if "ddtree" in stats:
        lines += render_ddtree(stats["ddtree"])
    if stats.get("phase_seconds"):
        took = progress.phase_line(stats["phase_seconds"])
        lines += ["", f"Where this stage's time went (this machine, under its load): {took}"]
    return "\n".join(lines) + "\n"


def write_plots(store: Store, fp: str, stats: dict[str, Any]) -> list[ShardEntry]:
    """Draw the evaluation plots beside report.md; their shard entries (`stats['plots']` names them)."""
    entries = []
    with tempfile.TemporaryDirectory(prefix="draftflow-plots-") as folder:
        stats["plots"] = draw_plots(stats, folder) + plot_ddtree(stats.get("ddtree"), folder)
        for name in stats["plots"]:
            with store.writing(store.stage_path(STAGE, fp, name)) as tmp:
                Path(tmp).write_bytes((Path(folder) / name).read_bytes())
                entries.append(shard_entry(name, tmp, rows=0))
    return entries


def phase_names(ecfg: EvaluateConfig) -> list[str]:
    """The phases `run` times, in order: only those its settings turn on."""
    wanted = {"compare_with": bool(ecfg.compare_with), "alignment": bool(ecfg.alignment),
              "vllm": ecfg.engine == "vllm"}
    return [p for p in ("decode", "baselines", "compare_with", "alignment", "ddtree", "vllm") if wanted.get(p, True)]


def _drafting(cfg: RunConfig) -> str:
    return drafter_spec(cfg.drafter.kind).drafting(cfg.drafter)


def run(store: Store, stamp: Stamp, cfg: RunConfig, target: TargetRef, curated: StageResult,
        trained: StageResult) -> Manifest:
    """Measure τ on the eval prompts; fail if decoding is not lossless."""
    from draftflow.chat import ChatFormat
    from draftflow.evaluation.cached import evaluate_prompts  # KV-cached unless evaluate.kv_cache is false

    model, tokenizer = load_target(target.path, cfg.target.dtype, cfg.evaluate.device)
    prompts, categories, n_eval, ids = eval_set(store, curated, ChatFormat(tokenizer), cfg.regenerate.enable_thinking,
                                                cfg.evaluate)
    drafter = load_drafter(store, trained, model)
    # Draft from features rounded like the stored ones the drafter was trained on.
    n_taps = len(drafter.config.target_layer_ids)
    rounding = functools.partial(round_trip, dtype=cfg.extract.dtype, n_taps=n_taps)
    eos = eos_token_ids(model, tokenizer)
    phases = progress.Phases(STAGE, phase_names(cfg.evaluate))
    stats = evaluate_prompts(model, drafter, prompts, cfg.evaluate, eos, rounding)
    phases.done("decode")
    stats["target"] = described_target(cfg.target.path, target.path)  # a GGUF target: which weights (else None)
    stats["heldout_tau"] = (trained.manifest.extra.get("metrics") or {}).get("heldout_tau")  # training's estimate
    stats["recipe"], stats["kind"] = cfg.train.recipe, cfg.drafter.kind  # the rehearsal pairs recipes by kind
    log.info("tau %.3f over %d steps (%d prompts)", stats["tau"], stats["steps"], stats["prompts"])
    add_comparisons(model, drafter, stats, prompts, categories, cfg.evaluate, eos, rounding)  # + baselines, speedup
    phases.done("baselines")
    stats["prompt_set"] = prompt_set(ids[: stats["prompts"]])  # which prompts: runs compare only on equal sets
    outputs = stats.pop("outputs")
    if cfg.evaluate.compare_with:  # other trained drafters, same prompts, same loop, lossless-checked
        others = [load_other(o, model, cfg.extract.dtype) for o in resolve_all(cfg.root, cfg.evaluate.compare_with)]
        stats["baselines"] |= decode_others(model, others, prompts[: len(outputs)], outputs,
                                            categories[: len(outputs)], cfg.evaluate, eos)
        phases.done("compare_with")
    if cfg.evaluate.alignment:  # DFlash only (None otherwise): do slot k's drafts match token a+k?
        stats["alignment"] = alignment_report(model, drafter, prompts[: len(outputs)], outputs, rounding)
        if (stats["alignment"] or {}).get("warning"):
            log.warning("evaluate: %s", stats["alignment"]["warning"])
        phases.done("alignment")
    # DFlash only (None otherwise): τ per DDTree budget, checked against the greedy outputs just verified.
    stats["ddtree"] = evaluate_ddtree(model, drafter, prompts[: len(outputs)], cfg.evaluate.ddtree_budgets,
                                      cfg.evaluate, eos, rounding, reference=outputs)
    phases.done("ddtree")
    if cfg.evaluate.engine == "vllm":
        job = ServeJob(target.path, prompts[: len(outputs)], cfg.evaluate.max_new_tokens, sorted(eos),
                       cfg.regenerate.vllm, cfg.target.dtype, categories=tuple(categories[: len(outputs)]))
        stats["vllm"], stats["served"] = serve_exports(store, cfg, target, trained, job, outputs, stats["tau"])
        phases.done("vllm")
    stats["phase_seconds"] = phases.seconds  # where this stage's time went (measured, like `speedup`)
    fp = stamp.fingerprint
    entries = write_plots(store, fp, stats)
    for name, text in (("report.json", json.dumps(stats, indent=2)), ("report.md", render_report(stats, cfg))):
        with store.writing(store.stage_path(STAGE, fp, name)) as tmp:
            Path(tmp).write_text(text)
            entries.append(shard_entry(name, tmp, rows=0))
    n = stats["prompts"]
    dropped = {"not_selected": n_eval - n} if n_eval > n else {}
    results = [ShardResult(shard=None, rows_in=n_eval, rows_out=n, dropped=dropped)]
    results += [ShardResult(shard=e, rows_in=0, rows_out=0) for e in entries]
    extra = {"tau": stats["tau"], "acceptance_rate": stats["acceptance_rate"],
             **({"vllm_tau": {f: r["tau"] for f, r in stats["vllm"].items()}} if stats.get("vllm") else {}),
             "report": "report.md", "evaluation": headline(stats),  # paths relative to the stage folder
             "ddtree": ddtree_taus(stats["ddtree"]),
             **({"serve_choice": serve_choice_summary(stats["served"]["choice"])}
                if (stats.get("served") or {}).get("choice") else {})}
    return finalize(store, stamp, results, extra=extra)


def serve_choice_summary(choice: dict[str, Any]) -> dict[str, Any]:
    """Per batch size, the setting chosen from measured costs and its figures (for the serve line and `status`)."""
    keep = ("setting", "predicted", "measured", "best_speculative", "best_predicted")
    return {b: {k: c[k] for k in keep} for b, c in choice.items()}


def _export_folders(store: Store, trained: StageResult, into: Path) -> dict[str, Path]:
    """Each export format of the train stage (its `extra.files`), copied (checksums verified) into a local folder."""
    folders: dict[str, Path] = {}
    for s in map(ShardEntry.model_validate, trained.manifest.extra.get("files", [])):
        parts = Path(s.name).parts
        if len(parts) == 3 and parts[0] == "export":
            local = Path(store.verify_sha(trained.stage, trained.fingerprint, s))
            (into / parts[1]).mkdir(parents=True, exist_ok=True)
            (into / parts[1] / parts[2]).write_bytes(local.read_bytes())
            folders[parts[1]] = into / parts[1]
    if not folders:
        raise ConfigError("evaluate.engine=vllm: the train stage recorded no exports; re-run train")
    return folders


def check_served(fmt: str, served, outputs: list[list[int]], tau: float | None, tolerance: float) -> None:
    """Fail when vLLM's tokens differ from greedy, or its τ from draftflow's by more than `tolerance`."""
    if len(served.tokens) != len(outputs):
        raise LosslessError(f"vLLM serving the {fmt} export answered {len(served.tokens)} of {len(outputs)} prompts")
    for i, (got, want) in enumerate(zip(served.tokens, outputs)):
        if got != want:
            pos = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise LosslessError(f"vLLM serving the {fmt} export: prompt {i} differs from greedy at generated "
                                f"position {pos}; vLLM's verification or the export is wrong")
    if tau is not None and served.tau is not None and abs(served.tau - tau) > tolerance:
        raise ServingMismatch(f"vLLM serving the {fmt} export measured tau {served.tau:.3f} but draftflow measured "
                              f"{tau:.3f} on the same {len(outputs)} prompts (evaluate.vllm_tau_tolerance="
                              f"{tolerance:g}): training and serving disagree (taps, mask token, attention)")


def serve_exports(store: Store, cfg: RunConfig, target: TargetRef, trained: StageResult, job: ServeJob,
                  outputs: list[list[int]], tau: float | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Serve every export with vLLM on `job.prompts`, checked lossless and against draftflow's τ; with
    `evaluate.served_batches` the vLLM-native export, vLLM's prompt lookup and plain decoding are also timed.

    Returns:
        (per format its τ, acceptance rates and drafting steps; the served-speedup record or None).
    """
    from draftflow.engines.vllm_serve import prompt_lookup_config, serve_with_vllm, speculative_config
    from draftflow.evaluation import served as served_speed

    report: dict[str, Any] = {}
    record, runs = None, {}
    with tempfile.TemporaryDirectory(prefix="draftflow-exports-") as tmp:
        folders = _export_folders(store, trained, Path(tmp))
        timing = bool(cfg.evaluate.served_batches and "vllm" in folders)
        # Its engine runs, for progress: each export format once (the vLLM-native one as a timed method), and when
        # timed plain decoding, each served baseline and at most one chosen setting per batch size.
        baselines, batches = len(cfg.evaluate.served_baselines), len(cfg.evaluate.served_batches)
        progress.count(STAGE, len(folders) + (1 + baselines + batches if timing else 0), "vLLM engine runs")
        if timing:
            drafts = speculative_config(folders["vllm"])["num_speculative_tokens"]
            methods = {cfg.drafter.kind: (folders["vllm"], None)}
            methods |= {name: (None, prompt_lookup_config(drafts)) for name in cfg.evaluate.served_baselines}
            timed = dataclasses.replace(job, batches=tuple(cfg.evaluate.served_batches), probe_positions=drafts + 1)
            record, timed_runs = served_speed.measure(timed, methods, outputs)
            runs["vllm"] = timed_runs[cfg.drafter.kind]
        for fmt, folder in folders.items():
            if fmt not in runs:
                runs[fmt] = serve_with_vllm(job, folder)
                progress.tick(STAGE)
            served = runs[fmt]
            check_served(fmt, served, outputs, tau, cfg.evaluate.vllm_tau_tolerance)
            report[fmt] = {"tau": served.tau, "acceptance_rate": served.acceptance_rate, "drafts": served.drafts}
    return report, record
