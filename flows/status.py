"""What `draftflow run`, `refresh`, `status` and `history` print: a run's summary lines, a root's stages, its
promoted drafter and its refreshes (the CLI's reading side; `flows/cli.py` parses the arguments)."""

from __future__ import annotations

import os

from draftflow.errors import DraftflowError


def _num(n) -> str:
    return "?" if n is None else f"{int(n):,}"


def _size(n) -> str:
    """Bytes as `plan.human_bytes` writes them (here, so `status` need not import the stages plan does)."""
    if n is None:
        return "-"
    units, k = ("B", "KiB", "MiB", "GiB", "TiB"), 0
    while abs(n) >= 1024 and k < len(units) - 1:
        n, k = n / 1024, k + 1
    return f"{n:.0f} B" if k == 0 else f"{n:.1f} {units[k]}"


def _duration(seconds) -> str:
    if seconds is None:
        return "-"
    for unit, span in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= span:
            return f"{seconds / span:.1f} {unit}"
    return f"{seconds:.1f} s"


def print_summary(summary: dict) -> None:
    """A run's lines: each stage, tau and the evaluation, the gate, the outputs and how to serve them."""
    w = max([11, *(len(s["stage"]) for s in summary["stages"])])  # the stage column fits every name
    for s in summary["stages"]:
        dropped = ", ".join(f"{k}={v}" for k, v in s["dropped"].items()) or "none"
        print(f"  {s['stage']:<{w}} {s['status']:<7} {s['rows_in']:>6} -> {s['rows_out']:<6} "
              f"{s.get('unit', 'rows'):<13} dropped {dropped:<28} {s['path']}")
    if summary.get("target"):  # what the weights are when they are not the target's own (a GGUF target)
        print(f"target: {summary['target']}")
    tau = summary["tau"]
    print(f"mean acceptance length tau = {'n/a' if tau is None else f'{tau:.3f}'}")
    from draftflow.evaluation.summary import console_lines

    for line in console_lines(summary.get("evaluation")):
        print(line)
    from draftflow.runs.gating import summary_line

    print(summary_line(summary.get("gate")))
    print(f"checkpoint: {summary['checkpoint']}")
    for fmt, path in summary.get("exports", {}).items():
        print(f"export ({fmt}): {path}")
        if summary.get("serve", {}).get(fmt):
            print(f"  serve: {summary['serve'][fmt]}")
    if summary.get("serve_note"):  # the serve setting chosen from measured costs, or "serve without speculation"
        print(f"serve setting: {summary['serve_note']}")
    if summary.get("stale"):  # the promoted drafter (what deployments serve) was trained for an older target
        print(f"promoted drafter: {summary['stale']}")
    print(f"report: {summary['report']}")


def cmd_history(args) -> int:
    """`draftflow history ROOT`: one line per finished refresh (`draftflow.refresh.history`)."""
    from draftflow.refresh import history
    from draftflow.store import Store

    root = args.root
    if root.endswith((".yaml", ".yml")):
        from draftflow.config import load_config

        root = load_config(root).root
    elif "://" not in root and not os.path.isdir(root):
        raise DraftflowError(f"no run root at {root}; give a run folder (e.g. runs/tiny) or the run's config YAML")
    lines = [history.line(e) for e in history.entries(Store(root))]
    print("\n".join(lines) if lines else f"no refresh has finished in {root} yet (draftflow refresh CONFIG)")
    return 0


def cmd_status(args) -> int:
    """One header line, then per stage: state, rows in -> out, dropped by reason, tokens, output folder;
    under the stage to run, how far it got (shards done, checkpointed rows or parts, train's resume step)."""
    from draftflow.config import load_config
    from draftflow.runs.runinfo import recorded_config, stage_status

    is_config = args.run.endswith((".yaml", ".yml")) or os.path.isfile(args.run)
    if args.overrides and not is_config:
        raise DraftflowError("--set needs the run's config file, not a run folder")
    cfg = load_config(args.run, args.overrides) if is_config else recorded_config(args.run)
    from draftflow.target import resolve_target

    target = resolve_target(cfg.target)
    stages = stage_status(cfg, target)
    done = sum(s["state"] == "complete" for s in stages)
    print(f"run {cfg.name}  root {cfg.root}  {done}/{len(stages)} stages complete")
    _print_promoted(cfg.root, target.fingerprint)
    for s in stages:
        if s["state"] != "complete":
            where = s["path"] or "(waits for its inputs)"
            print(f"  {s['stage']:<11} {s['state']:<9} {where}")
            if s.get("run"):  # running: who holds the root
                print(f"  {'':<11} {'':<9} by {s['run']}")
            if s["progress"]:
                print(f"  {'':<11} {'':<9} {_progress(s['progress'])}")
            for o in s["older"][:3]:  # why earlier results of this stage are not reused
                print(f"  {'':<11} {'':<9} older result {o['path']} differs in: {', '.join(o['why'])}")
            continue
        dropped = ", ".join(f"{k}={v}" for k, v in s["dropped"].items()) or "none"
        print(f"  {s['stage']:<11} {s['state']:<9} rows {s['rows_in']:>7} -> {s['rows_out']:<7} "
              f"tokens {_num(s['tokens']):>11}  {_size(s['bytes']):>10}  dropped {dropped}  {s['path']}")
        warm = (s["manifest"].extra or {}).get("init_from")  # a warm-started train stage
        if warm:
            print(f"  {'':<11} {'':<9} {_warm(warm)}")
    return 0


def _print_promoted(root: str, target_fingerprint: str) -> None:
    """The drafter in service (the root's promoted pointer), whether it is stale, and the refreshes so far."""
    from draftflow.promotion import OLD_POINTER_STAGE, pointer
    from draftflow.refresh import history
    from draftflow.store import Store
    from draftflow.training.warm import stale_promoted

    store = Store(root)
    current = (pointer(store) or {}).get("current")
    if current:
        tau = "-" if current.get("tau") is None else f"{current['tau']:.3f}"
        stage = current.get("stage", OLD_POINTER_STAGE)
        print(f"  promoted drafter: {stage}/{current['train']} tau {tau} since {current['at']} ({current['export']})")
    stale = stale_promoted(root, target_fingerprint)
    if stale:
        print(f"  promoted drafter: {stale}")
    done = history.entries(store)
    if done:
        print(f"  refreshes: {len(done)}, last: {history.line(done[-1])} (draftflow history {root})")


def _warm(w: dict) -> str:
    """A warm-started train stage: what it started from, and whether that drafter was trained for another target."""
    text = f"warm-started from {w['name']} (drafter {w['digest'][:12]})"
    if w.get("target_changed"):
        text += (f"; that drafter was trained for target {str(w['trained_for'])[:16]}, this run's target is another "
                 "revision")
    return text


def _progress(p: dict) -> str:
    """What an unfinished stage has done: shards committed and checkpointed, or train's resume step."""
    if "resume_step" in p:
        if p["resume_step"] is None:
            return "no checkpoint yet: starts at step 0"
        return f"resumes from step {p['resume_step']} ({p['checkpoint']})"
    text = f"{p['shards_done']}/{p['shards']} shards done"
    if p["partial_rows"] or p["partial_parts"]:
        held = f"{p['partial_rows']} rows" if p["partial_rows"] else f"{p['partial_parts']} part files"
        text += f", {held} checkpointed in unfinished shards"
    return text
