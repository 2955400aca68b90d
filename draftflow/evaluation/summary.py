"""How the categories, baselines and predicted speedup read: report.md sections, PNG plots, console lines.

`markdown(stats, drafter_title)` gives the report sections, `draw_plots(stats, folder)` the two
PNGs beside report.md (τ per category for the drafter and each baseline; the accepted-length
distribution per category), `headline(stats)` the few numbers the evaluate manifest keeps and
`console_lines(headline)` what `draftflow run` prints from them. What it does not know: stores,
Prefect, how the numbers were measured. Trade-off: plots are optional (no matplotlib: no PNG, the
tables carry the same numbers).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
PLOTS = ("tau_per_category.png", "accept_lengths_per_category.png")


def _f(value: float | None, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def _hist(counts: list[int]) -> str:
    """Accepted-length histogram as `count@length`, from length 1 (length 0 never happens)."""
    return " ".join(str(c) for c in counts[1:])


def category_table(stats: dict[str, Any]) -> list[str]:
    base = stats.get("baselines") or {}
    head = "| category | prompts | tokens | steps | τ | " + "".join(f"τ {n} | " for n in base)
    lines = [
        "## Per category (same prompts for every proposer)",
        "",
        head + "steps accepting ≥ k drafts | steps by accepted length 1, 2, … |",
        "|" + "---|" * (7 + len(base)),
    ]
    rows = dict(stats.get("categories") or {}) | {"**all**": stats}
    for name, c in rows.items():
        taus = "".join(
            f"{_f(b['categories'].get(name, {}).get('tau') if name != '**all**' else b['tau'])} | "
            for b in base.values()
        )
        rates = ", ".join(f"{r:.2f}" for r in c["acceptance_rate"])
        lines.append(
            f"| {name} | {c['prompts']} | {c['tokens']} | {c['steps']} | {_f(c['tau'])} | {taus}"
            f"{rates} | {_hist(c['accept_histogram'])} |"
        )
    return lines


def baseline_table(stats: dict[str, Any], drafter_title: str) -> list[str]:
    speed = (stats.get("speedup") or {}).get("predicted_per_proposer", {})
    setting = (stats.get("speedup") or {}).get("setting_per_proposer", {})
    lines = [
        "## Baselines (same prompts, same drafts per step, lossless-checked)",
        "",
        "| proposer | τ | steps | tokens | best setting | predicted speedup |",
        "|---|---|---|---|---|---|",
    ]
    rows = {f"{drafter_title} (trained)": (stats, "drafter")}
    rows |= {name: (b, name) for name, b in (stats.get("baselines") or {}).items()}
    for name, (b, key) in rows.items():
        lines.append(f"| {name} | {_f(b['tau'])} | {b['steps']} | {b['tokens']} | {setting.get(key) or '-'} | "
                     f"{_f(speed.get(key), '.2f')} |")
    return lines + [
        "",
        "no_draft proposes nothing (τ = 1 by construction); prompt_lookup copies the continuation "
        "of the latest earlier match of the last 3, 2 or 1 tokens (prompt lookup decoding, Saxena 2023; "
        "LLMA, Yang et al. 2023).",
    ]


def speedup_lines(speed: dict[str, Any] | None) -> list[str]:
    if not speed:
        return []
    ms = lambda s: f"{s * 1e3:.3f} ms"  # noqa: E731
    verify = ", ".join(f"{k}: {ms(t)}" for k, t in sorted((int(k), t) for k, t in speed["verify_s"].items()))
    choice = speed.get("choice") or {}
    lines = [
        "## Predicted speedup (this engine, batch 1)",
        "",
        *([f"- **withheld**: {speed['withheld']}"] if speed.get("withheld") else []),
        f"- the drafter at its best setting **{speed.get('drafter_setting') or '-'}: "
        f"×{_f(speed.get('predicted'), '.2f')}** by `{speed['model']}` (`draftflow.evaluation.serve_choice`)",
    ]
    if choice:
        lines.append(f"- the setting to serve here: **{choice['setting']}**"
                     + (f" (best speculative {choice['best_speculative']} ×{choice['best_predicted']:.2f})"
                        if choice["setting"] == "plain" else f" ×{choice['predicted']:.2f}"))
    if speed.get("table"):
        lines += ["", "| setting | τ(k) | predicted speedup |", "|---|---|---|"]
        lines += [f"| {name} | {row['tau']:.3f} | ×{row['predicted']:.2f} |" for name, row in speed["table"].items()]
        lines.append("")
    return lines + [
        f"- t_step {ms(speed['target_step_s'])} (target, 1 new token); t_verify by drafts k: {verify}; "
        "one drafting pass: " + ", ".join(f"{n} {ms(t)}" for n, t in speed["proposer_step_s"].items()),
        f"- measured on {speed['device']} at {speed['context_tokens']} context tokens, KV-cached target, "
        f"median of {speed['repeats']} repetitions after a warm-up, batch 1: measurements, they vary with load "
        "and are not fingerprinted",
    ]


def markdown(stats: dict[str, Any], drafter_title: str) -> str:
    """The categories, baselines and speedup sections of report.md (plots linked when drawn)."""
    lines = (
        category_table(stats) + [""] + baseline_table(stats, drafter_title) + [""] + speedup_lines(stats.get("speedup"))
    )
    lines += [""] + [f"![{p[:-4]}]({p})" for p in stats.get("plots", [])]
    return "\n".join(lines) + "\n"


def draw_plots(stats: dict[str, Any], folder: str | Path) -> list[str]:
    """τ per category (drafter and baselines) and accepted-length shares per category as PNGs in `folder`.

    Returns:
        The file names written (none without matplotlib).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError:
        log.warning("matplotlib is not installed; the evaluation report has no plots")
        return []
    import numpy as np

    cats = list(stats.get("categories") or {}) + ["all"]
    pick = lambda s, c: (s if c == "all" else s["categories"].get(c, {})).get("tau") or 0.0  # noqa: E731
    series = {"drafter": stats} | (stats.get("baselines") or {})
    fig = Figure(figsize=(8, 4), dpi=100)
    ax, width = fig.add_subplot(), 0.8 / len(series)
    for i, (name, s) in enumerate(series.items()):
        ax.bar(np.arange(len(cats)) + i * width, [pick(s, c) for c in cats], width, label=name)
    ax.set_xticks(np.arange(len(cats)) + 0.4 - width / 2, cats)
    ax.set_ylabel("mean acceptance length τ")
    ax.set_title("evaluate: τ per category")
    ax.legend()
    fig.tight_layout()
    fig.savefig(Path(folder) / PLOTS[0], format="png", metadata={"Software": None})
    fig = Figure(figsize=(8, 4), dpi=100)
    ax = fig.add_subplot()
    for c in cats:
        hist = np.array((stats if c == "all" else stats["categories"][c])["accept_histogram"][1:], float)
        ax.plot(np.arange(1, len(hist) + 1), hist / max(hist.sum(), 1.0), marker="o", label=c)
    ax.set_xlabel("accepted length per step (drafts accepted + 1)")
    ax.set_ylabel("share of steps")
    ax.set_title("evaluate: accepted length per category (drafter)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(Path(folder) / PLOTS[1], format="png", metadata={"Software": None})
    return list(PLOTS)


def headline(stats: dict[str, Any]) -> dict[str, Any]:
    """The few numbers the evaluate manifest keeps for the CLI and the result artifact."""
    speed = stats.get("speedup") or {}
    return {
        "tau_per_category": {c: s["tau"] for c, s in (stats.get("categories") or {}).items()},
        "baselines": {n: b["tau"] for n, b in (stats.get("baselines") or {}).items()},
        "speedup": {k: speed.get(k) for k in ("predicted", "drafter_setting", "choice", "device", "withheld")} | {
            "baselines": {n: x for n, x in (speed.get("predicted_per_proposer") or {}).items()
                          if n in (stats.get("baselines") or {})}} if speed else None,
        "served": {n: m["speedup"] for n, m in stats["served"]["methods"].items()} if stats.get("served") else None,
        "ddtree": {b: s["tau"] for b, s in (stats.get("ddtree") or {}).items()},  # DFlash: τ per DDTree budget
    }


def _predicted_line(s: dict[str, Any]) -> str:
    """The drafter's prediction at its best setting, the best baseline's beside it, or why there is none."""
    if s.get("withheld"):
        return f"predicted speedup withheld: {s['withheld']}"
    base = {n: x for n, x in (s.get("baselines") or {}).items() if x is not None}
    best = max(base.items(), key=lambda kv: kv[1], default=None)
    beside = f", best baseline {best[0]} x{best[1]:.2f}" if best else ""
    return (f"predicted speedup x{_f(s['predicted'], '.2f')} at {s.get('drafter_setting') or '-'}{beside} "
            f"(batch 1, costs measured on {s['device']})")


def console_lines(head: dict[str, Any] | None) -> list[str]:
    """What `draftflow run` prints after τ: τ per category, the baselines, the predicted speedup."""
    if not head:
        return []
    lines = []
    if head.get("tau_per_category"):
        lines.append("tau per category: " + ", ".join(f"{c} {_f(t)}" for c, t in head["tau_per_category"].items()))
    if head.get("baselines"):
        lines.append("baselines (same prompts): " + ", ".join(f"{n} tau {_f(t)}" for n, t in head["baselines"].items()))
    if head.get("speedup"):
        lines.append(_predicted_line(head["speedup"]))
    if head.get("served"):  # measured in vLLM: tokens/s with the method / without, per batch size
        lines.append("served speedup (vLLM, measured): " + "; ".join(
            f"{n} " + ", ".join(f"x{_f(x, '.2f')} at batch {b}" for b, x in per.items())
            for n, per in head["served"].items()))
    if head.get("ddtree"):  # budget b verifies b x (B-1) draft nodes; 1 = the plain block
        budgets = sorted(head["ddtree"].items(), key=lambda kv: int(kv[0]))
        lines.append("DDTree tau per budget (x block drafts): " + ", ".join(f"{b} {_f(t)}" for b, t in budgets))
    return lines
