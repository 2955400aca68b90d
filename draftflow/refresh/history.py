"""What each refresh decided: `<root>/refresh/history.json`, one entry per finished refresh, read by
`draftflow history` and the UI's tau-history artifact.

An entry: `{refresh, batch, at, new_rows, tau, live_tau, promoted, reason, train, evaluate, target}`; `tau` is the
candidate's, `live_tau` the promoted drafter's on the same prompts (None on a root with nothing promoted yet).
"""

from __future__ import annotations

from typing import Any

from draftflow.refresh.batches import FOLDER
from draftflow.store import Store

HISTORY = "history.json"


def entries(store: Store) -> list[dict[str, Any]]:
    path = store.path(FOLDER, HISTORY)
    return store.read_json(path)["refreshes"] if store.exists(path) else []


def finished(store: Store) -> set[int]:
    """The batch numbers whose refresh has ended (promoted or not)."""
    return {e["batch"] for e in entries(store)}


def record(store: Store, entry: dict[str, Any]) -> list[dict[str, Any]]:
    """Append one refresh's entry (numbered after the last), written whole; returns the history."""
    done = entries(store)
    done.append({"refresh": len(done) + 1, **entry})
    store.write_json(store.path(FOLDER, HISTORY), {"refreshes": done})
    return done


def _tau(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def line(e: dict[str, Any]) -> str:
    """`refresh <n>: <date> new_rows <n> tau <candidate> live_tau <promoted> promoted yes|no <reason>`."""
    return (f"refresh {e['refresh']}: {e['at'][:10]} new_rows {e['new_rows']} tau {_tau(e.get('tau'))} "
            f"live_tau {_tau(e.get('live_tau'))} promoted {'yes' if e['promoted'] else 'no'} {e['reason']}")


def markdown(history: list[dict[str, Any]], width: int = 40) -> str:
    """The tau-history document: a text plot of the candidate's and the live drafter's tau per refresh (a code
    block: the UI shows it as drawn, as it does train's held-out curve), then a table."""
    top = max([e.get(k) or 0.0 for e in history for k in ("tau", "live_tau")] + [1.0])
    plot = ["refresh  who        tau"]
    for e in history:
        for who, key in (("candidate", "tau"), ("live", "live_tau")):
            if e.get(key) is not None:
                bar = "#" * max(1, round(width * e[key] / top))
                mark = "  promoted" if who == "candidate" and e["promoted"] else ""
                plot.append(f"{e['refresh']:>7}  {who:<9} {e[key]:.3f}  {bar}{mark}")
    rows = "".join(f"| {e['refresh']} | {e['at']} | {e['new_rows']} | {_tau(e.get('tau'))} | "
                   f"{_tau(e.get('live_tau'))} | {'yes' if e['promoted'] else 'no'} | {e['reason']} |\n"
                   for e in history)
    return ("# tau across refreshes\n\n```\n" + "\n".join(plot) + "\n```\n\n"
            "| refresh | at | new rows | tau | live tau | promoted | why |\n|---|---|---|---|---|---|---|\n" + rows)
