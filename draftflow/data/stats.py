"""Curation statistics: per-source counts, prompt-length histograms, and their PNG.

Histograms use fixed, doubling bin edges (in characters), so histograms of
different runs and sources compare bin by bin. The PNG is drawn with
matplotlib's Agg backend (no display needed), imported only when drawn.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

EDGES = [0, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def bin_labels() -> list[str]:
    return [f"{a}-{b - 1}" for a, b in zip(EDGES, EDGES[1:])] + [f">={EDGES[-1]}"]


def histogram(lengths: np.ndarray) -> list[int]:
    """Counts per bin of `bin_labels()`."""
    bins = np.searchsorted(np.asarray(EDGES[1:]), lengths, side="right")
    return np.bincount(bins, minlength=len(EDGES)).tolist()


def source_stats(read: int, dropped: Counter, kept: int, lengths: np.ndarray) -> dict[str, Any]:
    """One source's figures for the manifest: read, kept, dropped by reason, duplicate rate, histogram."""
    dups = dropped.get("duplicate", 0) + dropped.get("near_duplicate", 0)
    valid = read - sum(v for k, v in dropped.items() if k not in ("duplicate", "near_duplicate", "mixture_cap"))
    return {
        "read": read, "kept": kept, "dropped": dict(sorted(dropped.items())),
        "duplicate_rate": round(dups / valid, 4) if valid else 0.0,
        "prompt_chars_median": int(np.median(lengths)) if len(lengths) else 0,
        "prompt_chars_histogram": histogram(lengths),
    }


def table_rows(per_source: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Flat rows for a table artifact: one per source, dropped reasons as columns."""
    reasons = sorted({r for s in per_source.values() for r in s["dropped"]})
    return [{"source": name, "read": s["read"], "kept": s["kept"], "duplicate_rate": s["duplicate_rate"],
             "median_prompt_chars": s["prompt_chars_median"],
             **{f"dropped:{r}": s["dropped"].get(r, 0) for r in reasons}} for name, s in per_source.items()]


def draw_histograms(path: str, per_source: dict[str, dict[str, Any]]) -> None:
    """A grouped bar chart of prompt lengths per source, written as PNG to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    labels = bin_labels()
    fig = Figure(figsize=(10, 4.5), dpi=100)
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(per_source))
    for i, (name, s) in enumerate(per_source.items()):
        ax.bar(np.arange(len(labels)) + i * width, s["prompt_chars_histogram"], width, label=name)
    ax.set_xticks(np.arange(len(labels)) + 0.4 - width / 2, labels, rotation=45, ha="right")
    ax.set_xlabel("prompt length (characters)")
    ax.set_ylabel("kept conversations")
    ax.set_title("curate: prompt lengths per source")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None})
