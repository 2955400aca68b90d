"""Served speedup, measured: the target in vLLM with and without each speculative method, timed.

The predicted speedup (`draftflow.evaluation.speedup`) comes from step costs timed in transformers, which on a
small target are mostly framework overhead. This module measures what a server delivers: vLLM decodes the same
eval prompts greedily (i) plainly, (ii) with the drafter's vLLM-native export and (iii) with vLLM's n-gram
prompt lookup, each at batch 1 and batch 8 (`evaluate.served_batches`), and reports output tokens per second,
the ratio to plain decoding at the same batch size, vLLM's acceptance length overall, per category and per draft
position, and whether every method's text equals plain decoding's (lossless, per batch size).

What it does not know: stores, exports' contents or report layout (`render` only formats this record).
Trade-off: each method is one engine start plus two decodes of the prompts (minutes on a CPU); the figures are
this machine's under its current load and are not fingerprinted content.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from draftflow import progress
from draftflow.engines.vllm_serve import ServeJob, serve_with_vllm
from draftflow.evaluation import serve_choice

log = logging.getLogger(__name__)


def per_category(categories: list[str], per_prompt: list[tuple[int, int]]) -> dict[str, float | None]:
    """vLLM's τ per category from its per-prompt (drafts, accepted) counters."""
    sums: dict[str, list[int]] = {}
    for cat, (drafts, accepted) in zip(categories, per_prompt):
        tot = sums.setdefault(cat, [0, 0])
        tot[0], tot[1] = tot[0] + drafts, tot[1] + accepted
    return {c: (1.0 + a / d if d else None) for c, (d, a) in sorted(sums.items())}


def _record(job: ServeJob, served, plain) -> dict[str, Any]:
    """One method's served figures against plain decoding."""
    lossless = {str(b): served.tokens_by_batch[b] == plain.tokens_by_batch[b] for b in job.batches}
    return {
        "tok_s": {str(b): served.tok_s[b] for b in job.batches},
        "speedup": {str(b): served.tok_s[b] / plain.tok_s[b] if plain.tok_s[b] else None for b in job.batches},
        "tau": served.tau,
        "tau_per_category": per_category(list(job.categories), served.per_prompt),
        "acceptance_rate": served.acceptance_rate,
        "drafts": served.drafts,
        "lossless": lossless,
    }


def measure(job: ServeJob, methods: dict[str, tuple[Path | None, dict[str, Any] | None]],
            greedy: list[list[int]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Plain decoding, then every method, in vLLM on the same prompts.

    Args:
        job: with `probe_positions` (the most drafts any method serves, plus one), plain decoding's engine also
            measures what verifying costs, and the serve setting is chosen and served (`choose_and_serve`).
        methods: name -> (export folder, None) or (None, speculative_config); decoded in this order.
        greedy: draftflow's own greedy outputs of the same prompts (how many plain vLLM matches is reported).

    Returns:
        (the `served` record of report.json: batches, plain tokens/s, per method `_record`;
         name -> `ServedResult` of each method, for the caller's lossless and τ checks).
    """
    plain = serve_with_vllm(job)  # with `job.probe_positions`, it also probes the cost of verifying
    progress.tick("evaluate")
    first = job.batches[0]
    same = sum(a == b for a, b in zip(plain.tokens_by_batch[first], greedy))
    out: dict[str, Any] = {
        "batches": list(job.batches),
        "prompts": len(job.prompts),
        "max_new_tokens": job.max_new_tokens,
        "dtype": job.dtype,
        "plain": {"tok_s": {str(b): plain.tok_s[b] for b in job.batches},
                  "equal_to_draftflow_greedy": f"{same}/{len(greedy)}"},
        "methods": {},
        "measured": "output tokens/s of vLLM's offline engine after a warm-up request; batch 1 = one request "
        "at a time; this machine under its current load, not fingerprinted",
    }
    runs = {}
    for name, (export, spec) in methods.items():
        runs[name] = serve_with_vllm(job, export, spec)
        progress.tick("evaluate")
        out["methods"][name] = _record(job, runs[name], plain)
        log.info("served %s: speedup %s", name, out["methods"][name]["speedup"])
    if plain.probe:
        out["choice"] = choose_and_serve(job, methods, plain, runs)
    else:
        progress.tick("evaluate", fewer=len(job.batches))  # no setting is chosen: none is served
    return out, runs


# How a proposer's drafting pass scales with the drafts k it is asked for (vLLM's method names), read from vLLM
# 0.32's code: DFlash drafts in one pass of k+1 queries (the bonus token and k masks; v1/spec_decode/dflash.py,
# any k >= 1 is accepted, the block size is never checked): "block", (k+1)/(K+1) of the measured pass; EAGLE-3
# runs one pass per draft: "chain", k/K; n-gram lookup searches the prompt: "free". What the parts do not carry:
# on vLLM 0.32's CPU build a DFlash round at k = 1 cost 1.47 plain steps against k = 2's 1.24 (SmolLM2, batch 1,
# repeated in either order; docs/results.md), so a prediction below the measured k can miss: the chosen setting is
# served and measured, and one measured slower than plain gives way to the runner-up (`runner_up`, served too),
# then to `best_measured`. EAGLE-3 at k = 1 did the same on 2026-12-06.
DRAFTING = serve_choice.DRAFTING


def _spec_of(export: Path | None, spec: dict[str, Any] | None) -> dict[str, Any]:
    from draftflow.engines.vllm_serve import speculative_config

    return spec if spec is not None else speculative_config(export)


def proposers_at(batch: int, job: ServeJob, methods: dict[str, tuple[Path | None, dict[str, Any] | None]],
                 plain, runs: dict[str, Any], verify: dict[int, float]) -> list[serve_choice.Proposer]:
    """Each measured method as a `Proposer` at `batch`: its acceptance by position (vLLM's counters), the share
    of its steps that draft, and what its measured steps cost beyond verifying: a drafter's drafting pass (which
    scales with k as vLLM drafts, `DRAFTING`); for n-gram lookup, which drafts nothing itself, a fixed cost
    of every step of its speculative path."""
    out = []
    for name, (export, spec) in methods.items():
        run, sc = runs[name], _spec_of(export, spec)
        K, how = int(sc["num_speculative_tokens"]), DRAFTING.get(sc["method"], "chain")
        tokens = sum(map(len, run.tokens_by_batch.get(job.batches[0], [])))
        share = min(1.0, run.drafts / max(1, tokens - run.accepted)) if how == "free" else 1.0
        if run.tau is None or K not in verify or not run.acceptance_rate or not run.tok_s.get(batch):
            continue
        tokens_per_step = 1.0 + share * (run.tau - 1.0)  # over every step, drafting or not
        step = serve_choice.spec_step_seconds(batch, tokens_per_step, run.tok_s[batch])
        rest = max(0.0, step - share * verify[K] - (1.0 - share) * plain_step(plain, batch))
        draft, overhead = (0.0, rest) if how == "free" else (rest, 0.0)
        out.append(serve_choice.Proposer(_label(sc), list(run.acceptance_rate[:K]),
                                         serve_choice.drafting_costs(draft, K, how), share, overhead))
    return out


def plain_step(plain, batch: int) -> float:
    """Seconds of one plain decoding step of `batch` sequences, from plain vLLM's tokens/s."""
    return batch / plain.tok_s[batch]


def choose_and_serve(job: ServeJob, methods: dict[str, tuple[Path | None, dict[str, Any] | None]], plain,
                     runs: dict[str, Any]) -> dict[str, Any]:
    """Per batch size: the setting predicted fastest (`serve_choice.choose`) from the costs measured here,
    then that setting served and measured (settings already measured are not served twice); one measured slower
    than plain decoding: the runner-up prediction served too (`runner_up`), then the fastest setting measured at
    least as fast as plain (`best_measured`), else plain."""
    choices: dict[int, serve_choice.Choice] = {}
    costs: dict[int, dict[str, Any]] = {}
    for b in job.batches:
        verify = serve_choice.verify_from_probe(plain_step(plain, b), plain.probe[b])
        proposers = proposers_at(b, job, methods, plain, runs, verify)
        choices[b] = serve_choice.choose(proposers, serve_choice.Costs(plain_step(plain, b), verify))
        costs[b] = {"step_s": plain_step(plain, b), "verify_s": verify,  # what the prediction read
                    "proposers": {p.name: {"drafting_share": p.drafting_share, "draft_s": p.draft_s,
                                           "overhead_s": p.overhead_s} for p in proposers}}
    chosen = {c.setting: _method_of(methods, c.setting) for c in choices.values() if c.setting != "plain"}
    served_as = {n: int(_spec_of(*methods[n])["num_speculative_tokens"]) for n in methods}
    again = [s for s, (name, k) in chosen.items() if k != served_as[name]]
    progress.tick("evaluate", fewer=len(job.batches) - len(again))  # `serve_exports` counted one per batch size
    measured = _serve_settings(job, methods, runs, served_as, chosen, tick=True)
    # A first choice measured slower than plain: the runner-up prediction is served once before any fallback
    # (vLLM 0.32's CPU build runs one draft slower than its parts say, for DFlash and EAGLE-3 alike).
    as_methods = {f"{_label(_spec_of(*methods[n]))}:k={served_as[n]}": runs[n] for n in methods if n in runs}
    slower = [c for b, c in choices.items() if c.setting in measured and measured[c.setting].tok_s[b] < plain.tok_s[b]]
    tries = {s: _method_of(methods, s) for s in (runner_up(c, set(measured) | set(as_methods)) for c in slower) if s}
    measured |= _serve_settings(job, methods, runs, served_as, tries, tick=False)
    out = {}
    for b, c in choices.items():
        run = measured.get(c.setting)
        speed = 1.0 if run is None else run.tok_s[b] / plain.tok_s[b]
        lossless = True if run is None else run.tokens_by_batch[b] == plain.tokens_by_batch[b]
        out[str(b)] = {"setting": c.setting, "predicted": c.predicted, "measured": speed, "lossless": lossless,
                       "best_speculative": c.best_speculative, "best_predicted": c.best_predicted,
                       "table": c.table, "costs": costs[b]}
        if speed < 1.0:  # the measurement overrules the prediction: never recommend what was measured slower
            overruled = {"setting": c.setting, "predicted": c.predicted, "measured": speed}
            setting, run = best_measured(b, plain, as_methods | measured)
            if run is None:
                out[str(b)] |= {"setting": "plain", "predicted": 1.0, "measured": 1.0, "lossless": True}
            else:  # another setting measured here (a method served with its own drafts) beat plain: that one
                out[str(b)] |= {"setting": setting, "predicted": c.table.get(setting, {}).get("predicted", 1.0),
                                "measured": run.tok_s[b] / plain.tok_s[b], "lossless": True}
            out[str(b)]["overruled"] = overruled
            log.warning("serve setting at batch %d: %s was predicted x%.2f but measured x%.2f: %s", b, c.setting,
                        c.predicted, speed, out[str(b)]["setting"])
    return out


def _serve_settings(job: ServeJob, methods: dict[str, tuple[Path | None, dict[str, Any] | None]], runs: dict[str, Any],
                    served_as: dict[str, int], settings: dict[str, tuple[str, int]], tick: bool) -> dict[str, Any]:
    """Each setting (-> (method name, drafts)) measured: a method's run where it was served with those drafts,
    else one more engine."""
    from draftflow.engines.vllm_serve import with_drafts

    measured: dict[str, Any] = {}
    for setting, (name, k) in settings.items():
        if k == served_as[name]:  # already measured as its method
            measured[setting] = runs[name]
        else:
            measured[setting] = serve_with_vllm(job, methods[name][0], with_drafts(_spec_of(*methods[name]), k))
            if tick:
                progress.tick("evaluate")
        log.info("served the chosen %s: tokens/s %s", setting, measured[setting].tok_s)
    return measured


def _method_of(methods: dict[str, tuple[Path | None, dict[str, Any] | None]], setting: str) -> tuple[str, int]:
    """(the method's name, drafts) of a setting `<proposer>:k=<k>`."""
    proposer, k = setting.split(":k=")
    return next(n for n, m in methods.items() if _label(_spec_of(*m)) == proposer), int(k)


def runner_up(choice: serve_choice.Choice, measured: set[str]) -> str | None:
    """The setting predicted fastest after `choice.setting` among those not yet measured, if it is predicted to
    beat plain decoding by `serve_choice.MARGIN`; else None."""
    best = serve_choice.fastest(choice.table, measured | {choice.setting})
    return best if best is not None and choice.table[best]["predicted"] >= serve_choice.MARGIN else None


def best_measured(batch: int, plain, runs: dict[str, Any]) -> tuple[str, Any]:
    """The setting (name -> its served run) measured fastest at `batch`, lossless and at least as fast as plain
    decoding; ("plain", None) when none is."""
    fine = {s: r for s, r in runs.items() if r is not None and r.tok_s.get(batch, 0.0) >= plain.tok_s[batch]
            and r.tokens_by_batch.get(batch) == plain.tokens_by_batch[batch]}
    if not fine:
        return "plain", None
    best = max(fine, key=lambda s: fine[s].tok_s[batch])
    return best, fine[best]


def _label(sc: dict[str, Any]) -> str:
    return "ngram" if DRAFTING.get(sc["method"]) == "free" else sc["method"]


def _f(x: float | None, spec: str = ".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def render(served: dict[str, Any] | None, draftflow_tau: dict[str, float | None]) -> list[str]:
    """The report.md section: tokens/s and speedup per method and batch size, τ by vLLM next to draftflow's.

    Args:
        draftflow_tau: method name -> draftflow's τ on the same prompts (None where not measured).
    """
    if not served:
        return []
    bs = [str(b) for b in served["batches"]]
    head = " | ".join(f"tok/s b{b} | speedup b{b} | lossless b{b}" for b in bs)
    lines = ["## Served speedup (vLLM, measured)", "",
             f"{served['prompts']} prompts, up to {served['max_new_tokens']} new tokens, {served['dtype']}; "
             f"{served['measured']}. Plain vLLM equals draftflow's greedy text on "
             f"{served['plain']['equal_to_draftflow_greedy']} prompts. Lossless: the method's text equals plain "
             "vLLM's at that batch size. vLLM's prompt lookup counts only steps where it found a match.", "",
             f"| method | τ vLLM | τ draftflow | {head} |", "|---" * (3 + 3 * len(bs)) + "|",
             "| plain | 1.000 | 1.000 | " + " | ".join(f"{served['plain']['tok_s'][b]:.1f} | 1.00 | yes" for b in bs)
             + " |"]
    for name, m in served["methods"].items():
        cells = " | ".join(f"{m['tok_s'][b]:.1f} | {_f(m['speedup'][b], '.2f')} | "
                           f"{'yes' if m['lossless'][b] else 'NO'}" for b in bs)
        lines.append(f"| {name} | {_f(m['tau'])} | {_f(draftflow_tau.get(name))} | {cells} |")
    lines += ["", "| method | " + " | ".join(f"τ vLLM {c}" for c in _categories(served)) + " |",
              "|---" * (1 + len(_categories(served))) + "|"]
    for name, m in served["methods"].items():
        lines.append(f"| {name} | " + " | ".join(_f(m["tau_per_category"].get(c)) for c in _categories(served)) + " |")
    return lines + render_choice(served.get("choice"))


def render_choice(choice: dict[str, Any] | None) -> list[str]:
    """The report.md section on the serve settings chosen from measured costs (`choose_and_serve`)."""
    if not choice:
        return []
    lines = ["", "## Serve settings chosen from measured step costs", "",
             "Predicted = tau(k) x plain step / (verify k drafts + drafting), each cost measured in vLLM here; the "
             "chosen setting was then served and measured.", "",
             "| batch | chosen | predicted | measured | lossless | best speculative (predicted) |",
             "|---|---|---|---|---|---|"]
    for b, c in choice.items():
        lines.append(f"| {b} | {c['setting']} | x{c['predicted']:.2f} | x{c['measured']:.2f} | "
                     f"{'yes' if c['lossless'] else 'NO'} | {c['best_speculative']} (x{c['best_predicted']:.2f}) |")
    lines += [f"- batch {b}: {c['overruled']['setting']} was predicted x{c['overruled']['predicted']:.2f} and "
              f"measured x{c['overruled']['measured']:.2f}, so the recommendation is "
              + ("plain decoding" if c["setting"] == "plain" else f"{c['setting']}, measured faster than plain here")
              for b, c in choice.items() if c.get("overruled")]
    settings = sorted({s for c in choice.values() for s in c["table"]})
    lines += ["", "| setting | tau | " + " | ".join(f"predicted b{b}" for b in choice) + " |",
              "|---" * (2 + len(choice)) + "|"]
    for name in settings:
        tau = next(c["table"][name]["tau"] for c in choice.values() if name in c["table"])
        cells = " | ".join(_f((c["table"].get(name) or {}).get("predicted"), ".2f") for c in choice.values())
        lines.append(f"| {name} | {tau:.3f} | {cells} |")
    return lines


def _categories(served: dict[str, Any]) -> list[str]:
    return sorted({c for m in served["methods"].values() for c in m["tau_per_category"]})
