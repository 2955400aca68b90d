"""The demo's training on a CPU, alone and beside a CPU burner: steps/s by torch thread setting.

Each setting trains the demo's drafter shape (configs/tiny.yaml: the tiny target, 2 layers, block 8,
32 anchors, 2 sequences a step) for `--steps` steps of `train_drafter` in a fresh process:
- `one`: DRAFTFLOW_TORCH_THREADS=1 (the baseline every ratio is against, measured in the same run);
- `every`: DRAFTFLOW_TORCH_THREADS = every core (what train did before the thread count was measured);
- `auto`: no setting: `draftflow.training.threads` measures the count on the first steps.
Then the same three beside a burner: one process spinning on one core for the whole measurement.

    python -m benchmarks.train_threads [--steps 400]

Ratios only, no pass/fail. On 2 idle cores here, every setting ran the demo's small ops at about the
same rate; beside a burner `every` fell by an order of magnitude (docs/results.md "Speed on a CPU").
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = "benchmarks.train_threads"


def burn(stop_at: float) -> None:
    x = 0
    while time.time() < stop_at:
        x += 1


def train_once(steps: int) -> float:
    """Steps per second of `steps` demo-shaped training steps in this process."""
    import torch

    from draftflow.config import DrafterConfig, TargetConfig, TrainConfig
    from draftflow.drafters.registry import DraftInputs, drafter_spec
    from draftflow.features import FeatureSample
    from draftflow.target import load_target, resolve_target
    from draftflow.training.loop import train_drafter

    ref = resolve_target(TargetConfig())
    model, tok = load_target(ref.path, "float32", "cpu")
    dcfg_user = DrafterConfig(num_layers=2, block_size=8, num_taps=3)
    spec = drafter_spec("dflash")
    dcfg = spec.config_from_target(model.config, dcfg_user, DraftInputs(mask_token_id=len(tok)))
    g = torch.Generator().manual_seed(0)
    n_taps, hidden = len(dcfg.feature_ids), model.config.hidden_size
    samples = []
    for i in range(64):
        T = int(torch.randint(80, 256, (1,), generator=g))
        samples.append(FeatureSample(f"s{i}", torch.randint(0, model.config.vocab_size - 1, (T,), generator=g),
                                     torch.ones(T, dtype=torch.bool), torch.randn(T, n_taps, hidden, generator=g)))
    tcfg = TrainConfig(epochs=1000, max_steps=steps, batch_size=2, lr=3e-3, num_anchors=32, checkpoint_every=10**6,
                       device="cpu")
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        train_drafter(samples, model, dcfg, tcfg, out, resume=False)
        return steps / (time.perf_counter() - t0)


def measure(setting: str, steps: int, cores: int) -> float:
    env = {k: v for k, v in os.environ.items() if k != "DRAFTFLOW_TORCH_THREADS"}
    if setting != "auto":
        env["DRAFTFLOW_TORCH_THREADS"] = "1" if setting == "one" else str(cores)
    out = subprocess.run([sys.executable, "-m", CHILD, "--child", str(steps)], env=env, capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parent.parent)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["steps_per_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--loads", default="idle,burner", help="idle, burner or both (comma-separated)")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps({"steps_per_s": train_once(args.child)}))
        return
    cores = len(os.sched_getaffinity(0))
    settings = ["one", "every", "auto"]
    rates: dict[tuple[str, str], float] = {}
    loads = args.loads.split(",")
    for load in loads:
        burner = None
        if load == "burner":
            burner = multiprocessing.Process(target=burn, args=(time.time() + 3600,), daemon=True)
            burner.start()
        try:
            for s in settings:
                rates[(load, s)] = measure(s, args.steps, cores)
        finally:
            if burner is not None:
                burner.terminate()
                burner.join()
    print(f"cores={cores} steps={args.steps} (demo shape; ratios against one thread in the same conditions)")
    for load in loads:
        base = rates[(load, "one")]
        line = "  ".join(f"{s} {rates[(load, s)]:.1f} steps/s (x{rates[(load, s)] / base:.2f})" for s in settings)
        print(f"{load:<6} {line}")


if __name__ == "__main__":
    main()
