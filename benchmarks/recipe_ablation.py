"""The recipe ablation: each objective option alone and combined, on the same features, steps and wall time.

Reads a run root whose extract stage holds the target's final state (a config with `drafter.distill_top_k` set,
e.g. `configs/smollm2.yaml`), then trains one drafter per variant in this process from the same stored
features and held-out sequences, and prints per variant its held-out acceptance (teacher-forced, on
sequences no variant trains on: `draftflow.training.heldout`) at the last step and at its best step, the
steps it ran and its wall time, with the ratio to the paper recipe measured in the same run:

    python -m benchmarks.recipe_ablation configs/smollm2.yaml [--set train.max_steps=300 ...] [--kinds dflash]

`--vary KEY=VALUE` sets a value on every variant but not on the run whose features they read, so settings that
change an earlier stage's fingerprint (DFlash's `drafter.block_size` sets tokenize's least supervised tokens) can
be compared on the same features: `--vary drafter.block_size=3 --vary train.num_anchors=48`.

Variants: paper (the papers' recipe exactly), +init (the target's last layers as the start), +distill (soft
labels, the target's top-k), +acceptance (the acceptance-oriented loss), then combinations, and DFlash's slot
weights (`train.gamma`: a fixed 0.5, or measured: draftflow's recipe), and for EAGLE-3 the positions scored read
off the tokens (`drafter.draftable: tokens`, draftflow's recipe: no pass of the target's whole head). Every variant
runs the same steps; its wall time is printed beside it (soft labels add one LM-head pass a step). A measurement,
not a test: the figures are this machine's, and docs/results.md "Recipes" records a dated run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

VARIANTS: dict[str, dict[str, Any]] = {
    "paper": {"recipe": "paper"},
    "+init": {"recipe": "paper", "init_from_target": True},
    "+distill": {"recipe": "paper", "distill_top_k": 8},
    "+acceptance": {"recipe": "paper", "acceptance_loss": True},
    "+init +distill": {"recipe": "paper", "init_from_target": True, "distill_top_k": 8},
    "+init +acceptance": {"recipe": "paper", "init_from_target": True, "acceptance_loss": True},
    "+init +distill +acceptance": {"recipe": "paper", "init_from_target": True, "distill_top_k": 8,
                                   "acceptance_loss": True},
    # DFlash's slot weights (`train.gamma`): a fixed decay, or the measured reach (draftflow's recipe)
    "+init gamma 0.5": {"recipe": "paper", "init_from_target": True, "gamma": 0.5},
    "+init gamma measured": {"recipe": "paper", "init_from_target": True, "gamma": "measured"},
    # EAGLE-3: the positions scored read off the tokens, not the target's whole head (`drafter.draftable`)
    "+init gamma measured +tokens": {"recipe": "paper", "init_from_target": True, "gamma": "measured",
                                     "draftable": "tokens"},
}


def objective_options() -> set[str]:
    """The drafter's objective options, as the recipes fill them (`RECIPE_OBJECTIVE`)."""
    from draftflow.config import RECIPE_OBJECTIVE

    return set(RECIPE_OBJECTIVE["paper"])


def kind_options(kind: str) -> set[str]:
    """The objective options drafter kind `kind` has: the shared ones and those its own settings declare (EAGLE-3's
    `draftable`, `drafters/<kind>/settings.py`)."""
    from draftflow.config.train import DrafterConfig, kind_settings

    settings = kind_settings(kind)
    return objective_options() & (set(DrafterConfig.model_fields) | set(settings.model_fields if settings else ()))


def variant_config(cfg, options: dict[str, Any]):
    """The run config of one variant: the drafter's objective options and the train settings, held-out
    measurement on for every variant (keep: last, so `best` below is what keep: best would export)."""
    from draftflow.config import RunConfig

    drafter = {k: v for k, v in options.items() if k in objective_options()}
    train = {k: v for k, v in options.items() if k not in drafter}
    data = cfg.model_dump(mode="json")
    reset = {k: None for k in kind_options(cfg.drafter.kind)}  # each option the kind has, filled by the recipe again
    data["drafter"] |= reset | drafter
    every = data["train"]["eval_every"]
    data["train"] |= {"init_from_target": None, "gamma": None} | train | {
        "eval_every": every if isinstance(every, int) else "auto", "keep": "last"}
    return RunConfig.model_validate(data)


def train_variant(store, cfg, target, features) -> dict[str, Any]:
    from draftflow.feature_stream import open_features
    from draftflow.target import load_target
    from draftflow.training.job import drafter_config, loss_tokens
    from draftflow.training.loop import Start, train_drafter

    model, tokenizer = load_target(target.path, cfg.target.dtype, cfg.target.device)
    dcfg, vocab = drafter_config(store, cfg, model, tokenizer, features)
    source = open_features(store, features.stage, features.fingerprint, features.shards)  # taps (+ the final state)
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        m = train_drafter(source, model, dcfg, cfg.train, out, resume=False,
                          start=Start(vocab, loss_tokens(store, cfg, features, vocab), drafter=cfg.drafter))
        took = time.perf_counter() - start
    history = m.get("heldout") or []
    best = max(history, key=lambda h: h["tau"] or 0.0) if history else {}
    return {"last_tau": history[-1]["tau"] if history else None, "best_tau": best.get("tau"),
            "best_step": best.get("step"), "steps": m["steps"], "seconds": round(took, 1),
            "acceptance_at_best": best.get("acceptance")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--variants", default=None, help="comma-separated names of VARIANTS (default: every one the "
                    "config's drafter kind has)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--vary", action="append", default=[], metavar="KEY=VALUE",
                    help="set on every variant but not on the run whose features it reads (e.g. drafter.block_size)")
    args = ap.parse_args()
    from draftflow.config import load_config
    from draftflow.contracts import feature_source
    from draftflow.runs.runstate import stage_states
    from draftflow.store import Store
    from draftflow.target import resolve_target

    base = load_config(args.config, args.overrides)
    store, target = Store(base.root), resolve_target(base.target)
    manifest = stage_states(base, target.fingerprint)[1].get("extract")
    if manifest is None:
        raise SystemExit(f"no complete extract stage for {args.config} in {base.root}: run it first "
                         "(draftflow run CONFIG --set ... stops nowhere earlier; its train stage may be cut short)")
    features = feature_source(manifest)
    varied = load_config(args.config, args.overrides + args.vary) if args.vary else base
    rows = {}
    names = args.variants.split(",") if args.variants else [  # the variants whose options the kind has
        n for n, o in VARIANTS.items() if set(o) & objective_options() <= kind_options(base.drafter.kind)]
    for name in names:
        cfg = variant_config(varied, VARIANTS[name])
        rows[name] = train_variant(store, cfg, target, features)
        print(f"{name}: {json.dumps(rows[name])}", flush=True)
    paper = (rows.get("paper") or {}).get("best_tau")
    print(f"\n| variant ({base.drafter.kind}) | held-out tau, last | best | at step | steps | seconds "
          "| x paper (best) |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        ratio = f"x{r['best_tau'] / paper:.3f}" if paper and r["best_tau"] else "-"
        print(f"| {name} | {r['last_tau']:.4f} | {r['best_tau']:.4f} | {r['best_step']} | {r['steps']} | "
              f"{r['seconds']} | {ratio} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
