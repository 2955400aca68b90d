"""Progress of long loops (rows, steps), reported to whoever listens: a terminal bar, the Prefect UI.

The library calls `report(stage, done, total, unit, part=...)` where it processes rows (one line per
loop); it knows nothing of who listens. The flows layer registers a sink that updates a Prefect
progress artifact, the CLI one that draws a terminal bar. With no sink registered (a notebook, a
test, a torchrun worker) a report is a dictionary update under a lock.

A stage's shards run in parallel threads, each reporting its own `part` (absolute counts, so a
repeated or late report is harmless); the stage's progress is the sum over parts. Sinks are called
at most once per their `interval` per stage (plus the first and the final report), so a loop that
reports every row never floods the Prefect API. A sink that raises is dropped with one warning:
progress is never worth failing a stage for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


MIN_RATE_SECONDS = 1.0  # elapsed time before a speed is shown


@dataclass(frozen=True)
class Progress:
    """A stage's progress at one moment: `done` of `total` `unit`s; `rate` per second since it began."""

    stage: str
    done: int
    total: int
    unit: str
    elapsed: float
    rate: float | None
    session: int  # a new number each time the stage begins (a second run in one process is a new bar)
    note: str = ""  # the stage's latest figure of its own (train: the held-out tau), shown after the rate

    @property
    def eta(self) -> float | None:
        """Seconds left at the current rate (None before a rate is known)."""
        if self.done >= self.total:
            return 0.0
        if self.unit == "phases":  # unlike steps (seconds to minutes each): their rate predicts nothing
            return None
        return None if not self.rate else (self.total - self.done) / self.rate

    @property
    def finished(self) -> bool:
        return self.total > 0 and self.done >= self.total

    def line(self) -> str:
        """`regenerate 120/444 rows (27%), 35.2 rows/s, ETA 9 s`."""
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        rate = "" if self.rate is None else f", {self.rate:.3g} {self.unit}/s"
        eta = "" if self.eta is None or self.finished else f", ETA {duration(self.eta)}"
        took = f", {duration(self.elapsed)}" if self.finished else ""
        note = f", {self.note}" if self.note else ""
        return f"{self.stage} {self.done}/{self.total} {self.unit}{pct}{rate}{eta}{took}{note}"


def duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 90:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.0f} s"


@dataclass
class _Stage:
    unit: str
    session: int
    declared: int = 0  # the stage's total, when the caller that fans out knows it
    parts: dict[str, tuple[int, int]] = field(default_factory=dict)  # part -> (done, total)
    started: float = field(default_factory=time.monotonic)
    skipped: set[str] = field(default_factory=set)  # parts found done elsewhere (cached): not speed
    note: str = ""

    def snapshot(self, stage: str) -> Progress:
        done = sum(d for d, _ in self.parts.values())
        total = max(self.declared, sum(t for _, t in self.parts.values()))
        elapsed = time.monotonic() - self.started
        worked = done - sum(self.parts[p][0] for p in self.skipped)
        # No speed (nor ETA) from the first instants: one step in a millisecond is not a rate.
        rate = worked / elapsed if elapsed >= MIN_RATE_SECONDS and worked > 0 else None
        return Progress(stage, done, total, self.unit, elapsed, rate, self.session, self.note)


@dataclass
class _Sink:
    fn: Callable[[Progress], None]
    interval: float
    last: dict[tuple[str, int], float] = field(default_factory=dict)
    ended: set[tuple[str, int]] = field(default_factory=set)  # (stage, session)s whose final report it heard


_lock = threading.Lock()
_stages: dict[str, _Stage] = {}
_sinks: dict[str, _Sink] = {}
_sessions = 0


_documents: dict[str, Callable[[str, str, str], None]] = {}


def add_document_sink(name: str, fn: Callable[[str, str, str], None]) -> None:
    """Register (or replace) `name`, which hears every `document(stage, key, markdown)`."""
    with _lock:
        _documents[name] = fn


def document(stage: str, key: str, markdown: str) -> None:
    """A stage's live document changed (train: the held-out tau against step): tell the document sinks.

    The newest document of a (stage, key) replaces the last one (the Prefect UI keeps each as a version).
    A sink that raises is dropped with one warning, as progress sinks are."""
    with _lock:
        sinks = list(_documents.items())
    for name, fn in sinks:
        try:
            fn(stage, key, markdown)
        except Exception as exc:
            log.warning("document listener %s failed (%s: %s); it is switched off", name, type(exc).__name__, exc)
            with _lock:
                _documents.pop(name, None)


def add_sink(name: str, fn: Callable[[Progress], None], interval: float = 1.0) -> None:
    """Register (or replace) the listener `name`; it hears each stage at most once per `interval` s."""
    with _lock:
        _sinks[name] = _Sink(fn, interval)


def remove_sink(name: str) -> None:
    with _lock:
        _sinks.pop(name, None)


def begin(stage: str, total: int, unit: str = "rows") -> None:
    """Start (or restart) a stage's progress with the total its caller knows (e.g. rows of all shards)."""
    global _sessions
    with _lock:
        _sessions += 1
        _stages[stage] = _Stage(unit=unit, session=_sessions, declared=int(total))
    _emit(stage)


def finish(stage: str) -> Progress | None:
    """The stage's last progress; its sinks hear it even within their interval. None if it never began."""
    snap = snapshot(stage)
    if snap is not None:
        _emit(stage, force=True)
    return snap


def report(stage: str, done: int, total: int, unit: str = "rows", part: str = "", skipped: bool = False,
           note: str | None = None) -> None:
    """`part` of `stage` has `done` of `total` units done (absolute counts; parts run in parallel).

    `skipped`: the part was found done (e.g. a cached shard), so it does not count towards the rate.
    `note`: a figure of the stage's own to show with its progress from now on (train: the held-out tau).
    A report on a finished stage that is not itself finished starts the stage anew (a second run).
    """
    global _sessions
    with _lock:
        st = _stages.get(stage)
        if st is None or (done < total and st.snapshot(stage).finished):
            _sessions += 1
            st = _stages[stage] = _Stage(unit=unit, session=_sessions)
        st.parts[part] = (int(done), int(total))
        if note is not None:
            st.note = note
        if skipped:
            st.skipped.add(part)
    _emit(stage)


def snapshot(stage: str) -> Progress | None:
    with _lock:
        st = _stages.get(stage)
        return None if st is None else st.snapshot(stage)


def _emit(stage: str, force: bool = False) -> None:
    now = time.monotonic()
    due: list[tuple[str, _Sink]] = []
    with _lock:
        snap = _stages[stage].snapshot(stage)
        for name, sink in _sinks.items():
            key = (stage, snap.session)
            if key in sink.ended:
                continue
            if key not in sink.last or force or snap.finished or now - sink.last[key] >= sink.interval:
                sink.last[key] = now
                if snap.finished:
                    sink.ended.add(key)
                due.append((name, sink))
    for name, sink in due:
        try:
            sink.fn(snap)
        except Exception as exc:  # a listener's failure (e.g. an API hiccup) must not fail the stage
            log.warning("progress listener %s failed (%s: %s); it is switched off", name, type(exc).__name__, exc)
            remove_sink(name)


class Phases:
    """Wall time per phase of a stage whose work is a few unlike steps (evaluate: decode, baselines, DDTree,
    vLLM), not rows: each `done(name)` reports `k/n phases` as progress, logs the phase's time, and keeps it
    in `seconds` (name -> s, rounded to 0.1) for the stage's report. A measurement of this machine under its
    load, like a log line: never fingerprinted, never compared between runs."""

    def __init__(self, stage: str, names: list[str]) -> None:
        self.stage, self.names, self.seconds = stage, list(names), {}
        self._mark = time.monotonic()
        self._counted: list | None = None  # [done, total, unit] of the phase in progress (`count`, `tick`)
        _phases[stage] = self
        report(stage, 0, len(self.names), "phases")

    def done(self, name: str) -> None:
        self._counted = None
        now = time.monotonic()
        self.seconds[name] = round(now - self._mark, 1)
        self._mark = now
        report(self.stage, len(self.seconds), max(len(self.names), len(self.seconds)), "phases", note="")
        log.info("%s: %s took %s", self.stage, name, duration(self.seconds[name]))
        if len(self.seconds) >= len(self.names):
            _phases.pop(self.stage, None)

    def within(self, done: int, total: int, unit: str) -> None:
        """How far the phase in progress got (`decode 12/24 prompts`), shown with the stage's progress: phases are
        unlike, so their count alone says nothing for minutes, and no ETA is drawn from it."""
        now = self.names[len(self.seconds)] if len(self.seconds) < len(self.names) else "finishing"
        report(self.stage, len(self.seconds), max(len(self.names), len(self.seconds)), "phases",
               note=f"{now} {done}/{total} {unit}")


_phases: dict[str, Phases] = {}


def count(stage: str, total: int, unit: str) -> None:
    """The phase of `stage` in progress is `total` units of work done by calls spread over several functions
    (evaluate's vLLM engine runs); each `tick` counts one."""
    phases = _phases.get(stage)
    if phases is not None:
        phases._counted = [0, total, unit]
        phases.within(0, total, unit)


def tick(stage: str, fewer: int = 0) -> None:
    """One unit of the counted phase done (`fewer`=n, with no unit done: n of the planned units will not run)."""
    phases = _phases.get(stage)
    if phases is not None and phases._counted is not None:
        c = phases._counted
        c[0] += 0 if fewer else 1
        c[1] = max(c[0], c[1] - fewer)
        phases.within(*c)


def within(stage: str, done: int, total: int, unit: str) -> None:
    """A loop inside a phase of `stage` (evaluate's decode, DDTree) says how far it got; nothing when the stage
    keeps no `Phases` (a library caller outside a stage)."""
    phases = _phases.get(stage)
    if phases is not None:
        phases.within(done, total, unit)


def phase_line(seconds: dict[str, float]) -> str:
    """`decode 3.1 min, baselines 52 s, ...`: `Phases.seconds` in the order the phases ended."""
    return ", ".join(f"{name} {duration(s)}" for name, s in seconds.items())
