"""`draftflow compare RUN...`: τ and predicted speedup of several evaluations side by side.

Each RUN is a run root, an evaluate folder or a report.json (`draftflow.runs.evalruns.resolve`), or a run
config (`from_config`: the evaluation its stages resolve to now, which loads the config and reads its status). The
table has one column per evaluation and one row per figure its report.json holds: overall τ,
predicted speedup, τ per category, τ of each baseline, τ per DDTree budget, and the last gate
verdict. Reports written before a key existed simply leave that row blank ("-"): every key but
`tau` is read as optional. `plot` draws τ per category and τ per DDTree budget as one PNG.

What it does not know: Prefect, torch, how the figures were measured (it reads report.json files and, for a
run config, manifests, so it answers in about a second; matplotlib is imported only for `--png`). Trade-off: the
rows are the union over the runs, so a run that lacks a figure shows "-" rather than hiding the row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from draftflow.runs.evalruns import Evaluation, NoEvaluation, evaluate_stage, from_folder, resolve

Figures = dict[str, float | None]


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _budget_order(name: str) -> tuple[int, str]:
    return (int(name), "") if str(name).isdigit() else (1 << 30, str(name))


def figures(report: dict[str, Any]) -> Figures:
    """The comparable figures of one report.json, in table order (absent keys are left out)."""
    out: Figures = {"tau": _num(report.get("tau"))}
    speed = report.get("speedup")
    if isinstance(speed, dict):
        out["speedup (predicted)"] = _num(speed.get("predicted"))
    for name, c in (report.get("categories") or {}).items():
        out[f"tau {name}"] = _num((c or {}).get("tau"))
    for name, b in (report.get("baselines") or {}).items():
        out[f"tau baseline {name}"] = _num((b or {}).get("tau"))
    native = (report.get("vllm") or {}).get("vllm")
    if isinstance(native, dict):
        out["tau vllm"] = _num(native.get("tau"))
    for name, m in ((report.get("served") or {}).get("methods") or {}).items():
        for b, x in (m.get("speedup") or {}).items():
            out[f"speedup served b{b} {name}"] = _num(x)
    tree = report.get("ddtree") or {}
    for budget in sorted(tree, key=_budget_order):
        out[f"tau ddtree {budget}"] = _num((tree[budget] or {}).get("tau"))
    return out


def table_rows(evs: list[Evaluation]) -> tuple[list[str], list[list[str]]]:
    """(row names, cells per row: one per evaluation); names are the union of the reports' figures."""
    per = [figures(e.report) for e in evs]
    names: list[str] = []
    for f in per:
        names += [n for n in f if n not in names]
    ddtree = sorted((n for n in names if n.startswith("tau ddtree ")), key=lambda n: _budget_order(n[11:]))
    names = [n for n in names if not n.startswith("tau ddtree ")] + ddtree
    cells = [[_cell(n, f.get(n)) for f in per] for n in names]
    names.append("gate")
    cells.append([_gate(e.gate) for e in evs])
    return names, cells


def _cell(name: str, value: float | None) -> str:
    if value is None:
        return "-"
    return f"x{value:.2f}" if name.startswith("speedup") else f"{value:.3f}"


def _gate(verdict: dict[str, Any] | None) -> str:
    if not verdict:
        return "-"
    return "promoted" if verdict.get("promoted") else "failed"


def table(evs: list[Evaluation]) -> str:
    """The comparison as text: a legend of the runs ([1] label  path), then the aligned table."""
    names, cells = table_rows(evs)
    heads = [f"[{i}]" for i in range(1, len(evs) + 1)]
    width = max(len(n) for n in names)
    cols = [max(len(h), *(len(row[j]) for row in cells)) for j, h in enumerate(heads)]
    lines = [f"[{i}] {e.label}  {e.path}" for i, e in enumerate(evs, 1)] + [""]
    lines.append(f"{'':<{width}}  " + "  ".join(h.rjust(w) for h, w in zip(heads, cols)))
    for name, row in zip(names, cells):
        lines.append(f"{name:<{width}}  " + "  ".join(c.rjust(w) for c, w in zip(row, cols)))
    return "\n".join(lines)


def plot(evs: list[Evaluation], path: str | Path) -> Path:
    """τ per category (bars, one per evaluation) and τ per DDTree budget (lines) as one PNG.

    Raises:
        ModuleNotFoundError: matplotlib is not installed (a dependency of draftflow).
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    per = [figures(e.report) for e in evs]
    cats = ["tau"] + sorted(
        {n for f in per for n in f if n.startswith("tau ") and not n.startswith(("tau ddtree ", "tau baseline "))}
    )
    fig = Figure(figsize=(11, 4.2), dpi=100)
    bars, curve = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    width = 0.8 / len(evs)
    for i, (e, f) in enumerate(zip(evs, per)):
        bars.bar([k + i * width for k in range(len(cats))], [f.get(c) or 0.0 for c in cats], width,
                 label=legend_label(i + 1, e, f))
        tree = sorted(
            (
                (int(n[11:]), v)
                for n, v in f.items()
                if n.startswith("tau ddtree ") and n[11:].isdigit() and v is not None
            )
        )
        if tree:
            curve.plot([b for b, _ in tree], [v for _, v in tree], marker="o", label=f"[{i + 1}]")
    for (name, tau), style in zip(baselines(per).items(), ("--", ":", "-.", (0, (1, 3)))):
        bars.hlines(tau, -width / 2, 0.8 - width / 2, colors="black", linestyles=style,
                    label=f"baseline {name}: τ {tau:.2f}")  # over "all", the prompts the baselines decoded
    bars.set_xticks([k + 0.4 - width / 2 for k in range(len(cats))], ["all" if c == "tau" else c[4:] for c in cats])
    bars.set_ylabel("mean acceptance length τ")
    bars.set_title("τ per category")
    top = max([f.get(c) or 0.0 for f in per for c in cats] + list(baselines(per).values()) + [1.0])
    bars.set_ylim(0, top * (1.3 + 0.06 * (len(evs) + len(baselines(per)))))  # room for the legend above the bars
    bars.legend(fontsize=8, loc="upper left")
    curve.set_xscale("log", base=2)
    curve.set_xlabel("DDTree node budget")
    curve.set_ylabel("τ")
    curve.set_title("τ per DDTree budget" if curve.lines else "τ per DDTree budget (no DDTree results)")
    if curve.lines:
        curve.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", metadata={"Software": None})
    return out


def legend_label(i: int, e: Evaluation, f: Figures) -> str:
    """`[1] tiny · dflash · 6ce8a785 (x1.93)`: the run's name, its drafter's kind, its short fingerprint and
    predicted speedup (a bare report.json: its path)."""
    name = e.label.rsplit("/", 1)[0] if e.fingerprint and e.label.endswith(e.fingerprint) else e.label
    kind = (((e.manifest.config if e.manifest else None) or {}).get("drafter") or {}).get("kind")
    parts = [name, *([kind] if kind else []), *([e.fingerprint[:8]] if e.fingerprint else [])]
    speed = f.get("speedup (predicted)")
    return f"[{i}] " + " · ".join(parts) + (f" (x{speed:.2f})" if speed is not None else "")


def baselines(per: list[Figures]) -> dict[str, float]:
    """Each baseline's τ (prompt lookup, no draft, ...) from the first evaluation that has it."""
    out: dict[str, float] = {}
    for f in per:
        for n, v in f.items():
            if n.startswith("tau baseline ") and v is not None:
                out.setdefault(n.removeprefix("tau baseline "), v)
    return out


def rehearsal_line(report: dict[str, Any], paper: dict[str, Any] | None = None) -> str | None:
    """`rehearsal <kind>: tau T paper_tau P vllm_tau V prompt_lookup_tau L serve_b1 S predicted_b1 X speedup_b1 Y
    serve_b8 S speedup_b8 Y` (scripts read it) for a report with a served-speedup record: `paper` is the paper
    recipe's report of the same kind on the same prompts; each serve setting is the one chosen from measured
    costs at that batch size and its speedup is measured against plain decoding; "nan" for what is missing."""
    served = report.get("served") or {}
    kinds = [m for m in served.get("methods") or {} if m != "prompt_lookup"]
    if not kinds:
        return None
    figs, choice = figures(report), served.get("choice") or {}
    cells: list[tuple[str, Any]] = [
        ("tau", figs["tau"]), ("paper_tau", _num((paper or {}).get("tau"))), ("vllm_tau", figs.get("tau vllm")),
        ("prompt_lookup_tau", figs.get("tau baseline prompt_lookup"))]
    for b in ("1", "8"):
        c = choice.get(b) or {}
        cells.append((f"serve_b{b}", c.get("setting", "nan")))
        if b == "1":
            cells.append(("predicted_b1", _num(c.get("predicted"))))
        cells.append((f"speedup_b{b}", _num(c.get("measured"))))
    text = " ".join(f"{k} {v if isinstance(v, str) else ('nan' if v is None else f'{v:.3f}')}" for k, v in cells)
    return f"rehearsal {report.get('kind') or kinds[0]}: {text}"


def paper_report(e: Evaluation, evs: list[Evaluation]) -> dict[str, Any] | None:
    """The paper recipe's evaluation of `e`'s drafter kind among `evs` (same prompts), for `e` under recipe
    draftflow; None otherwise."""
    kind = e.report.get("kind")
    if e.report.get("recipe", "draftflow") == "paper" or kind is None:
        return None
    return next((o.report for o in evs if o.report.get("recipe") == "paper" and o.report.get("kind") == kind
                 and o.report.get("prompt_set") == e.report.get("prompt_set")), None)


def from_config(path: str, overrides: list[str] | None) -> Evaluation:
    """The evaluation a run config resolves to today (its evaluate fingerprint), which must be complete."""
    from draftflow.config import load_config
    from draftflow.runs.runinfo import stage_status

    cfg = load_config(path, overrides)
    row = next(s for s in stage_status(cfg) if s["stage"] == evaluate_stage())
    got = from_folder(row["path"]) if row["state"] == "complete" else None
    if got is None:
        raise NoEvaluation(f"the evaluate stage of {path} is not complete ({row['state']}); "
                           f"run `draftflow run {path}` first")
    got.label = cfg.name
    return got


def compare(runs: list[str], png: str | None = None, lines: bool = False, overrides: list[str] | None = None) -> str:
    """The comparison table of every evaluation the `runs` name (and the PNG at `png`, if given).

    Raises:
        NoEvaluation: a RUN holds no evaluation (one line naming it).
    """
    evs: list[Evaluation] = []
    for run in runs:
        evs += [from_config(run, overrides)] if run.endswith((".yaml", ".yml")) else resolve(run)
    seen: dict[str, int] = {}
    for e in evs:  # the same label twice (two roots both named `run`): number them
        seen[e.label] = seen.get(e.label, 0) + 1
        if seen[e.label] > 1:
            e.label = f"{e.label}#{seen[e.label]}"
    text = table(evs)
    if lines:  # one machine-readable line per evaluation that measured a served speedup
        text += "".join(f"\n{line}" for e in evs if (line := rehearsal_line(e.report, paper_report(e, evs))))
    if png:
        text += f"\nplot: {plot(evs, png)}"
    return text
