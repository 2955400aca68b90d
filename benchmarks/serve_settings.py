"""Serve settings from measured costs, outside a run: the setting predicted fastest at each batch size, then
measured, against plain decoding measured in the same run (the baseline every ratio is against).

For a config whose run has a complete train stage (e.g. after `make rehearsal`), it serves the target in vLLM
on the run's eval prompts: plain decoding (with the verify-cost probe), the drafter's vLLM export with all its
drafts and vLLM's n-gram lookup, then the chosen setting (`draftflow.evaluation.served.choose_and_serve`), and
prints per batch size the chosen setting, its predicted and measured speedup, and every candidate's prediction:

    .venv-vllm/bin/python -m benchmarks.serve_settings configs/smollm2.yaml [--set evaluate.num_prompts=12]

Needs vLLM (`make .venv-vllm/.installed`). A measurement of this machine under its load, not a test.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--curate", default=None, help="the curate stage's fingerprint (default: this code's)")
    ap.add_argument("--train", default=None, help="the train stage's fingerprint (default: this code's)")
    args = ap.parse_args()
    from draftflow.chat import ChatFormat
    from draftflow.config import load_config
    from draftflow.engines.vllm_serve import ServeJob, prompt_lookup_config, speculative_config
    from draftflow.evaluation import served
    from draftflow.runs.runstate import stage_states
    from draftflow.stages.common import stage_result
    from draftflow.stages.evaluate import _export_folders, eval_set
    from draftflow.store import Store
    from draftflow.target import eos_token_ids, load_target, resolve_target

    cfg = load_config(args.config, args.overrides)
    store, target = Store(cfg.root), resolve_target(cfg.target)
    manifests = stage_states(cfg, target.fingerprint)[1]
    for stage, fp in (("curate", args.curate), ("train", args.train)):
        if fp:  # a stage this code would fingerprint otherwise (made by an earlier commit)
            manifests[stage] = store.read_manifest(stage, fp)
        if manifests.get(stage) is None:
            raise SystemExit(f"no complete {stage} stage for {args.config} in {cfg.root}: run it, or name one "
                             f"with --{stage} FINGERPRINT")
    result = {s: stage_result(store, manifests[s], "reused") for s in ("curate", "train")}
    model, tokenizer = load_target(target.path, cfg.target.dtype, "cpu")
    prompts, cats, _, _ = eval_set(store, result["curate"], ChatFormat(tokenizer), cfg.regenerate.enable_thinking,
                                   cfg.evaluate)
    batches = tuple(int(b) for b in args.batches.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        export = _export_folders(store, result["train"], Path(tmp))["vllm"]
        drafts = speculative_config(export)["num_speculative_tokens"]
        job = ServeJob(target.path, prompts, cfg.evaluate.max_new_tokens, sorted(eos_token_ids(model, tokenizer)),
                       cfg.regenerate.vllm, cfg.target.dtype, batches, tuple(cats), probe_positions=drafts + 1)
        del model
        methods = {cfg.drafter.kind: (export, None), "prompt_lookup": (None, prompt_lookup_config(drafts))}
        record, _ = served.measure(job, methods, greedy=[])
    print("\n".join(served.render_choice(record.get("choice"))))
    for b, c in (record.get("choice") or {}).items():
        ratio = c["measured"] / c["predicted"] if c["predicted"] else float("nan")
        print(f"batch {b}: chosen {c['setting']} predicted x{c['predicted']:.3f} measured x{c['measured']:.3f} "
              f"(measured / predicted {ratio:.3f}); plain {record['plain']['tok_s'][b]:.1f} tok/s")


if __name__ == "__main__":
    main()
