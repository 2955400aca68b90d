"""New traffic as numbered batches, behind a watermark that survives crashes.

Layout under the run root:

    refresh/watermark.json          every batch: its files (URL -> size), rows kept, held out, rejected by reason
    refresh/traffic/batch-0003/     train.jsonl, recent.jsonl (the held-out slice), rejects.jsonl

`take_batch` returns the batch a refresh works on: the newest one whose refresh has not finished (a refresh
killed mid-train resumes it: its stages come from the cache), else one made of the log files no batch holds yet,
else None. A file is in the watermark only once its batch's files are written (each written whole, then
renamed), so a crash before that reads the file again into the same batch, split the same way.

What it does not know: Prefect, the stages. The batch's rows reach curate as two sources (`sources_for`), so
dedup against everything curated before and decontamination against the eval prompts are curate's, as for
any source.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from draftflow.config.refresh import RefreshConfig
from draftflow.data.readers import read_file
from draftflow.data.sources import BadRow
from draftflow.data.traffic import conversation, holdout, log_files
from draftflow.errors import ConfigError
from draftflow.store import Store

log = logging.getLogger(__name__)
FOLDER, WATERMARK = "refresh", "watermark.json"


@dataclass
class Batch:
    """One batch of new traffic: its number, the files it read, and what it kept."""

    n: int
    files: dict[str, int]
    rows: int = 0  # conversations kept for training
    held_out: int = 0  # conversations in the recent-traffic eval slice
    rejected: dict[str, int] = field(default_factory=dict)
    at: str = ""

    @property
    def new_rows(self) -> int:
        return self.rows + self.held_out


def folder(store: Store, n: int | str, *parts: str) -> str:
    name = n if isinstance(n, str) else f"batch-{n:04d}"
    return store.path(FOLDER, "traffic", name, *parts)


def watermark(store: Store) -> list[Batch]:
    """Every batch taken so far, oldest first."""
    path = store.path(FOLDER, WATERMARK)
    if not store.exists(path):
        return []
    return [Batch(**b) for b in store.read_json(path)["batches"]]


def _save(store: Store, batches: list[Batch]) -> None:
    store.write_json(store.path(FOLDER, WATERMARK), {"batches": [b.__dict__ for b in batches]})


def take_batch(store: Store, rcfg: RefreshConfig, finished: set[int]) -> tuple[Batch | None, bool]:
    """(the batch to refresh on, whether it is one an earlier refresh left unfinished); (None, False) when no log
    file is new.

    Args:
        finished: the batch numbers whose refresh ended (`history`).

    Raises:
        ConfigError: no traffic path is set, or nothing is there.
    """
    batches = watermark(store)
    pending = [b for b in batches if b.n not in finished]
    if pending:
        return pending[-1], True
    files = traffic_files(rcfg)
    seen = {f for b in batches for f in b.files}
    new = {f: size for f, size in files if f not in seen}
    if not new:
        return None, False
    batch = _write_batch(store, Batch(n=len(batches) + 1, files=new), rcfg.holdout)
    _save(store, [*batches, batch])  # only now are the files seen: their rows are committed above
    return batch, False


def check_traffic(store: Store, rcfg: RefreshConfig, finished: set[int]) -> None:
    """Before any work (`draftflow refresh` asks before Prefect starts): a refresh that has no unfinished batch to
    resume needs its traffic path. Raises ConfigError in one line (`traffic_files`)."""
    if all(b.n in finished for b in watermark(store)):
        traffic_files(rcfg)


def traffic_files(rcfg: RefreshConfig) -> list[tuple[str, int]]:
    """The log files under `refresh.traffic` (`traffic.log_files`); `draftflow refresh` asks before Prefect starts.

    Raises:
        ConfigError: no traffic path is set, or nothing is there (one line naming the setting).
    """
    if not rcfg.traffic:
        raise ConfigError("no traffic to refresh from: set refresh.traffic in the config or pass --traffic PATH "
                          "(a folder or s3:// prefix of JSONL request logs)")
    try:
        return log_files(rcfg.traffic)
    except FileNotFoundError:
        raise ConfigError(f"refresh.traffic={rcfg.traffic} does not exist; point it at the folder or s3:// prefix "
                          "the request logs are written to") from None


def _write_batch(store: Store, batch: Batch, fraction: float) -> Batch:
    """Read the batch's files into train / recent / rejects JSONL files (each written whole, then renamed)."""
    out: dict[str, list[str]] = {"train": [], "recent": [], "rejects": []}
    reasons: Counter[str] = Counter()
    seen: set[str] = set()
    for path in sorted(batch.files):
        for lineno, item in enumerate(read_file(path), 1):
            try:
                if isinstance(item, BadRow):
                    raise item
                row = conversation(item)
            except BadRow as bad:
                reasons[bad.reason] += 1
                out["rejects"].append(json.dumps({"file": path, "line": lineno, "reason": bad.reason,
                                                  "detail": bad.detail, "row": _raw(item, bad)}))
                continue
            text = json.dumps(row, sort_keys=True, ensure_ascii=False)
            if text in seen:  # the same request logged twice in this batch (curate dedups across batches)
                reasons["duplicate_in_batch"] += 1
                continue
            seen.add(text)
            out["recent" if holdout(row, fraction) else "train"].append(text)
    for name, lines in out.items():
        if lines:
            store.write_bytes(folder(store, batch.n, f"{name}.jsonl"), ("\n".join(lines) + "\n").encode())
    batch.rows, batch.held_out, batch.rejected = len(out["train"]), len(out["recent"]), dict(reasons)
    batch.at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    log.info("traffic batch %d: %d files, %d conversations (%d held out), rejected %s", batch.n, len(batch.files),
             batch.new_rows, batch.held_out, dict(reasons) or "nothing")
    return batch


def _raw(item: Any, bad: BadRow) -> Any:
    return bad.row if isinstance(item, BadRow) else item


def sources_for(store: Store, batch: Batch, category: str) -> list[dict[str, Any]]:
    """The curate sources a refresh on `batch` adds: every batch's training rows up to it, and its held-out slice
    as eval rows of `category`."""
    out = []
    if any(b.rows for b in watermark(store) if b.n <= batch.n):
        out.append({"name": "traffic", "path": store.url(folder(store, "batch-*", "train.jsonl")), "format": "openai"})
    if batch.held_out:
        out.append({"name": f"traffic_{category}", "path": store.url(folder(store, batch.n, "recent.jsonl")),
                    "format": "openai", "split": "eval", "category": category})
    return out
