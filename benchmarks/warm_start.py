"""Warm start against cold start after new data arrives: how many steps a warm start needs to catch up.

Reads a run root whose extract stage is complete (e.g. after `draftflow run configs/tiny.yaml`), then, in this
process, on the stored features:
1. `promoted`: a cold drafter trained on the "old" data, the sequences minus a slice that plays the new
   conversations (1 in 6 by sample-id hash: the new data is +20% of the old);
2. `cold`: a cold drafter trained on everything (old + new) for `train.max_steps` steps, held-out acceptance
   measured along the way; its best held-out τ is the bar;
3. `warm`: a drafter warm-started from `promoted` (`train.init_from`'s path: `warm.check_and_state`) trained on
   everything, held-out acceptance measured every `--every` steps; the first step at which it reaches the bar.

Both runs on everything hold out the same sequences (`draftflow.training.heldout` splits by id), which the
promoted drafter never trained on either. Prints the steps each needed and the ratio warm / cold:

    python -m benchmarks.warm_start configs/tiny.yaml [--set train.max_steps=300 ...] [--every 10]

A measurement, not a test: the figures are this machine's (docs/results.md records a dated run).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
from typing import Any

NEW_SHARE = 6  # 1 sequence in NEW_SHARE is "new": +20% on top of the other 5/6


class Subset:
    """The sequences of a feature source at `indices`, as the training loop reads a source."""

    def __init__(self, source, indices: list[int]):
        self.source, self.indices = source, indices
        self.sample_ids = [source.sample_ids[i] for i in indices]
        if hasattr(source, "lengths"):
            self.lengths = [source.lengths[i] for i in indices]

    def __len__(self) -> int:
        return len(self.indices)

    def take(self, idx: list[int]):
        return self.source.take([self.indices[i] for i in idx])


def is_new(sample_id: str) -> bool:
    return int(hashlib.sha256(f"new:{sample_id}".encode()).hexdigest()[:8], 16) % NEW_SHARE == 0


def first_reaching(history: list[dict[str, Any]], bar: float) -> int | None:
    """The first measured step whose held-out τ reaches `bar`, or None."""
    return next((h["step"] for h in history if (h["tau"] or 0.0) >= bar), None)


def train(samples, model, dcfg, tcfg, start=None) -> tuple[dict[str, Any], Any, float]:
    from draftflow.drafters.registry import spec_for_architecture
    from draftflow.training.loop import Start, train_drafter

    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        metrics = train_drafter(samples, model, dcfg, tcfg, out, resume=False, start=start or Start())
        took = time.perf_counter() - t0
        drafter = spec_for_architecture(dcfg.architecture).model.load(out, model)
    return metrics, drafter, took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--every", type=int, default=10, help="held-out measurement interval (steps)")
    ap.add_argument("--extract", default=None, help="an extract fingerprint of the root (default: the config's; give "
                    "it to read features another code version extracted)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    from draftflow.config import load_config
    from draftflow.contracts import feature_source
    from draftflow.feature_stream import open_features
    from draftflow.runs.runstate import stage_states
    from draftflow.store import Store
    from draftflow.target import load_target, resolve_target
    from draftflow.training.job import drafter_config
    from draftflow.training.loop import Start
    from draftflow.training.warm import InitDrafter

    cfg = load_config(args.config, [*args.overrides, f"train.eval_every={args.every}", "train.keep=last"])
    store, target = Store(cfg.root), resolve_target(cfg.target)
    manifest = (store.read_manifest("extract", args.extract) if args.extract
                else stage_states(cfg, target.fingerprint)[1].get("extract"))
    if manifest is None:
        raise SystemExit(f"no complete extract stage for {args.config} in {cfg.root}: run it first")
    features = feature_source(manifest)
    model, tokenizer = load_target(target.path, cfg.target.dtype, cfg.target.device)
    dcfg, vocab = drafter_config(store, cfg, model, tokenizer, features)
    every = open_features(store, features.stage, features.fingerprint, features.shards)
    old = Subset(every, [i for i, s in enumerate(every.sample_ids) if not is_new(s)])
    print(f"sequences: old {len(old)}, new {len(every) - len(old)} (+{(len(every) - len(old)) / len(old):.0%}), "
          f"steps {cfg.train.max_steps}, held-out every {args.every}", flush=True)
    _, promoted, t_promoted = train(old, model, dcfg, cfg.train, Start(vocab))
    cold, _, t_cold = train(every, model, dcfg, cfg.train, Start(vocab))
    init = (InitDrafter("benchmark", "(in memory)", ""), promoted)
    warm, _, t_warm = train(every, model, dcfg, cfg.train, Start(vocab, init=init))
    bar = max((h["tau"] or 0.0) for h in cold["heldout"])
    cold_at, warm_at = first_reaching(cold["heldout"], bar), first_reaching(warm["heldout"], bar)
    rows = {"bar_tau": bar, "cold_steps_to_bar": cold_at, "warm_steps_to_bar": warm_at,
            "warm_first_tau": warm["heldout"][0]["tau"], "cold_first_tau": cold["heldout"][0]["tau"],
            "warm_best_tau": max((h["tau"] or 0.0) for h in warm["heldout"]),
            "seconds": {"promoted": round(t_promoted, 1), "cold": round(t_cold, 1), "warm": round(t_warm, 1)}}
    print(json.dumps(rows))
    steps = cold["steps"]
    ratio = (f"x{warm_at / steps:.2f} the cold run's {steps} steps (x{warm_at / cold_at:.2f} the steps the cold start "
             "took to reach it)") if warm_at and cold_at else "- (the warm start did not reach the bar)"
    print(f"\nwarm start reaches the cold drafter's best held-out tau {bar:.4f} at step {warm_at}, the cold start at "
          f"step {cold_at}: {ratio}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
