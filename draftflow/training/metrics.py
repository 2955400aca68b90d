"""Training metrics written at the end of a run: TensorBoard events, a JSON summary, PNG curves.

Inputs are what training already produces: the final metrics dict of
`draftflow.training.loop.train_drafter` (loss, accuracy per slot k = 1..B-1, tau_est, any
throughput numbers) and the per-step loss history that the training loop keeps in
its checkpoint state (`checkpoints/step_*/state.pt`, key `loop.history`). Per-step
accuracy is not kept by the loop (only a window of recent steps), so accuracy is
written once, at the last step, per position.

What it does not know: Prefect (`metrics_table` returns rows a flow can publish as an
artifact), stores (it writes a local folder; the train stage copies it). Trade-off:
written once after training rather than live, so the training loop stays untouched;
`tensorboard --logdir <run>/metrics/tensorboard` still shows the whole loss curve.
"""

from __future__ import annotations

import json
import logging
import math
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch

from draftflow.training.checkpoint import latest_checkpoint

logger = logging.getLogger(__name__)

METRICS_DIR = "metrics"
TB_DIR = "tensorboard"
TB_EVENTS = "events.out.tfevents.draftflow"  # fixed: no time, host or pid in a fingerprinted name
SUMMARY_JSON = "training_metrics.json"
LOSS_PNG = "loss.png"
ACCURACY_PNG = "accuracy.png"
HELDOUT_PNG = "heldout_tau.png"
SMOOTH = 20  # steps in the moving average drawn over the raw loss


def loss_history(out_dir: str | Path) -> list[float | None]:
    """Per-step losses (None for a step without labels) from the newest checkpoint; [] if none."""
    ckpt = latest_checkpoint(out_dir)
    if ckpt is None:
        return []
    try:
        blob = torch.load(ckpt / "state.pt", map_location="cpu", weights_only=True)
        return [None if x is None else float(x) for x in blob["loop"]["history"]]
    except (OSError, KeyError, TypeError, RuntimeError, pickle.UnpicklingError) as exc:
        logger.warning("no loss history in %s (%s): curves show the final values only", ckpt, exc)
        return []


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numeric top-level entries of a metrics dict (loss, tau_est, throughput, ...)."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[key] = float(value)
    return out


def write_metrics(out_dir: str | Path, metrics: dict[str, Any], history: list[float | None] | None = None) -> list[str]:
    """Write `<out_dir>/metrics/`: TensorBoard events, the JSON summary and the PNG curves.

    Args:
        out_dir: the local training folder (the one `train_drafter` wrote).
        metrics: `train_drafter`'s return value.
        history: per-step losses; default: read from the newest checkpoint in `out_dir`.

    Returns:
        The written files, relative to `out_dir` (e.g. `metrics/loss.png`).
    """
    folder = Path(out_dir) / METRICS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    history = loss_history(out_dir) if history is None else history
    step = int(metrics.get("steps") or len(history))
    write_tensorboard(folder / TB_DIR, metrics, history, step)
    summary = {"final": metrics, "loss_history": history}
    (folder / SUMMARY_JSON).write_text(json.dumps(summary, indent=2))
    plot_loss(folder / LOSS_PNG, history)
    plot_accuracy(folder / ACCURACY_PNG, list(metrics.get("accuracy") or []))
    if metrics.get("heldout"):
        plot_heldout(folder / HELDOUT_PNG, metrics["heldout"], metrics.get("kept_step"))
    return sorted(str(p.relative_to(out_dir)) for p in folder.rglob("*") if p.is_file())


def write_tensorboard(log_dir: Path, metrics: dict[str, Any], history: list[float | None], step: int) -> None:
    """`train/loss` per step; final scalars under `final/` and `accuracy/pos_k` at the last step.

    One events file under a fixed name (`TB_EVENTS`) with wall times derived from the step, never the
    clock: SummaryWriter names its file after the time, host and pid and stamps every event with the
    time, which made a resumed run's train manifest (and so evaluate's fingerprint) differ from an
    uninterrupted run's. TensorBoard reads any file whose name contains `tfevents`.
    """
    from tensorboard.compat.proto.event_pb2 import Event  # needs the `tensorboard` package
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.record_writer import RecordWriter

    events = [Event(wall_time=0.0, step=0, file_version="brain.Event:2")]

    def scalar(tag: str, value: float, at: int) -> None:
        events.append(Event(wall_time=float(at), step=at, summary=Summary(value=[Summary.Value(tag=tag,
                                                                                              simple_value=value)])))

    for i, loss in enumerate(history, start=1):
        if loss is not None:
            scalar("train/loss", loss, i)
    for key, value in scalars(metrics).items():
        scalar(f"final/{key}", value, step)
    scored = [(k, acc) for k, acc in enumerate(metrics.get("accuracy") or [], start=1) if acc is not None]
    for k, acc in scored:  # None: a slot no recent step scored (an EAGLE-3 unroll step not trained)
        scalar(f"accuracy/pos_{k}", float(acc), step)  # slot k predicts token anchor+k
    for h in metrics.get("heldout") or []:  # held-out acceptance while training (`train.eval_every`)
        if h.get("tau") is not None:
            scalar("heldout/tau", float(h["tau"]), int(h["step"]))
            for k, a in enumerate(h.get("acceptance") or [], start=1):
                scalar(f"heldout/accept_{k}", float(a), int(h["step"]))
    shutil.rmtree(log_dir, ignore_errors=True)  # a re-run replaces the events, never appends a second file
    log_dir.mkdir(parents=True)
    with open(log_dir / TB_EVENTS, "wb") as fh:
        writer = RecordWriter(fh)
        for event in events:
            writer.write(event.SerializeToString())


def _figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg: no display, no pyplot state
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), dpi=100)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot(1, 1, 1)


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` values."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot_loss(path: Path, history: list[float | None]) -> None:
    fig, ax = _figure()
    points = [(i, x) for i, x in enumerate(history, start=1) if x is not None]
    if points:
        steps, losses = zip(*points)
        ax.plot(steps, losses, alpha=0.35, label="loss")
        ax.plot(steps, moving_average(list(losses), SMOOTH), label=f"mean of {SMOOTH} steps")
        ax.legend()
    ax.set(xlabel="optimizer step", ylabel="weighted block loss", title="training loss")
    fig.tight_layout()
    fig.savefig(path)


def plot_accuracy(path: Path, accuracy: list[float | None]) -> None:
    fig, ax = _figure()
    scored = [(k, a) for k, a in enumerate(accuracy, start=1) if a is not None]  # None: a slot not scored
    ax.plot([k for k, _ in scored], [a for _, a in scored], marker="o")
    ax.set(xlabel="block position k (predicts token anchor+k)", ylabel="accuracy", ylim=(0, 1),
           title="Per-position accuracy (last steps)")
    fig.tight_layout()
    fig.savefig(path)


def plot_heldout(path: Path, history: list[dict[str, Any]], kept_step: int | None) -> None:
    """Held-out τ against the step (`train.eval_every`), the kept step marked."""
    fig, ax = _figure()
    points = [(h["step"], h["tau"]) for h in history if h.get("tau") is not None]
    if points:
        ax.plot(*zip(*points), marker="o", label="held-out tau (teacher-forced)")
        kept = [(s, t) for s, t in points if s == kept_step]
        if kept:
            ax.plot(*zip(*kept), marker="*", markersize=14, linestyle="none", label=f"kept (step {kept_step})")
        ax.legend()
    ax.set(xlabel="optimizer step", ylabel="tau", title="Held-out acceptance while training")
    fig.tight_layout()
    fig.savefig(path)


def metrics_table(metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows {metric, value} for a table artifact: the scalars, then accuracy per position."""
    rows = [{"metric": k, "value": round(v, 6)} for k, v in scalars(metrics).items()]
    rows += [{"metric": f"accuracy@{k}", "value": round(float(a), 6)}
             for k, a in enumerate(metrics.get("accuracy") or [], start=1) if a is not None]
    return rows
