"""How many torch threads a CPU loop uses: measured on the loop's own steps, not assumed.

Why: on a CPU, torch's intra-op threads only pay when each op is large enough, and only while the cores
are free. The tiny demo's drafter gains nothing from a second thread idle, and beside one other busy
process two threads made its training 34 times slower than one (OpenMP threads spin at each op's barrier
waiting for the thread that lost its core). Neither the op size nor the machine's load is known in advance,
and load changes during a run, so `ThreadChooser` times the loop's own steps: a short probe of each
candidate count (1, 2, 4, ... up to the cores this process may use), then the fastest per unit of work
(tokens) until the next probe, `reprobe_s` seconds later.

What it does not know: what a step does (the caller times its own steps), Prefect, GPUs (a CUDA loop never
asks). `DRAFTFLOW_TORCH_THREADS` fixes the count and turns the probe off (a bit-exact reproduction across
runs wants one fixed count: reductions may round differently with another number of threads).
Trade-off: a probe spends a few steps at a slower count, about 2% of a run's steps at the defaults.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

ENV = "DRAFTFLOW_TORCH_THREADS"
PROBE_STEPS = 3  # timed steps per candidate; the median is kept (one step may meet a hiccup)
REPROBE_S = 60.0  # seconds between probes: load that arrives mid-run is noticed within a minute or so
# Probes take at most this share of a loop's time: one of evaluate's steps is a whole prompt (~13 s idle here, minutes
# beside other work), and with a fixed interval the chooser probed again as soon as it had chosen, every other
# prompt at the slow count (2026-12-07: 6 of 48 prompts decoded in 18 min beside CI's legs, 13 s a prompt idle)
PROBE_SHARE = 0.1


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask; a container's cpuset), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def fixed_threads() -> int | None:
    """The count `DRAFTFLOW_TORCH_THREADS` fixes, or None when it is unset."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        from draftflow.errors import ConfigError

        raise ConfigError(f"{ENV}={value!r} is not a positive whole number of threads; unset it to let draftflow "
                          "measure the best count")
    return int(value)


def candidates(cores: int) -> list[int]:
    """1, 2, 4, ... and `cores` itself: the counts a probe tries."""
    out, n = [], 1
    while n < cores:
        out.append(n)
        n *= 2
    return out + [cores]


@dataclass
class Work:
    """The size of one timed step, in the caller's units (tokens, prompts)."""

    units: float = 1.0


class ThreadChooser:
    """Picks the torch thread count for a loop of similar steps by timing them.

    Use `with chooser.step(units) as s:` around each step (`units`: its work, e.g. tokens, so steps of
    different sizes compare; a step that learns its size as it goes sets `s.units` before it ends).
    Probing steps run at each candidate in turn; then the fastest count per unit is kept until `reprobe_s`
    seconds have passed, or longer where the probe itself took long, so probes take at most `PROBE_SHARE` of the
    loop's time. The very first step is never timed (allocations and caches warm up in it).
    """

    def __init__(self, cores: int | None = None, probe_steps: int = PROBE_STEPS, reprobe_s: float = REPROBE_S,
                 clock: Callable[[], float] = time.perf_counter, set_threads: Callable[[int], None] | None = None):
        self.candidates = candidates(cores or usable_cores())
        self.probe_steps, self.reprobe_s, self.clock = probe_steps, reprobe_s, clock
        self.set_threads = set_threads or torch.set_num_threads
        self.chosen: int | None = None
        self.choices: list[tuple[int, dict[int, float]]] = []  # (chosen, seconds per unit of each candidate)
        self._samples: dict[int, list[float]] = {}
        self._chosen_at = self._probe_from = 0.0
        self._interval = reprobe_s  # seconds the choice holds: reprobe_s, or longer after a long probe
        self._warm = False

    @property
    def enabled(self) -> bool:
        return len(self.candidates) > 1

    def _probing(self) -> int | None:
        """The candidate the next step probes, or None when no probe is under way."""
        for n in self.candidates:
            if len(self._samples.get(n, ())) < self.probe_steps:
                return n
        return None

    def _decide(self) -> None:
        per_unit = {n: sorted(xs)[len(xs) // 2] for n, xs in self._samples.items()}
        self.chosen = min(per_unit, key=lambda n: (per_unit[n], n))  # ties: fewer threads
        self.choices.append((self.chosen, per_unit))
        self._chosen_at, self._samples = self.clock(), {}
        self._interval = max(self.reprobe_s, (self._chosen_at - self._probe_from) * (1 - PROBE_SHARE) / PROBE_SHARE)
        rates = ", ".join(f"{n}: {1 / s:.3g}/s" if s > 0 else f"{n}: -" for n, s in sorted(per_unit.items()))
        log.info("torch threads: %d (measured units per second by thread count: %s)", self.chosen, rates)

    @contextmanager
    def step(self, units: float = 1.0) -> Iterator[Work]:
        """Run one step at the count this chooser wants now, timing it when it is part of a probe."""
        work = Work(units)
        if not self.enabled:
            yield work
            return
        if self.chosen is not None and self.clock() - self._chosen_at >= self._interval:
            self.chosen = None  # time for a fresh probe: the machine's load may have changed
        probe = self._probing() if self.chosen is None else None
        threads = probe if probe is not None else self.chosen
        self.set_threads(threads if threads is not None else self.candidates[0])
        start = self.clock()
        yield work
        if not self._warm:
            self._warm = True
            return
        if probe is not None and not self._samples:
            self._probe_from = start  # the probe's first timed step: its cost is counted from here
        if probe is not None:
            self._samples.setdefault(probe, []).append((self.clock() - start) / max(work.units, 1e-9))
            if self._probing() is None:
                self._decide()


def chooser_for(device: torch.device, local_ranks: int = 1) -> ThreadChooser | None:
    """A chooser for a loop on `device`: None on GPUs and when `DRAFTFLOW_TORCH_THREADS` fixes the count
    (which is then applied here).

    `local_ranks` processes of one distributed run share this machine: each gets an even share of the cores,
    set once and never probed. A rank that changed its count mid-run would race the collective library's
    worker threads, which run torch ops of their own (a CI run saw a gloo rank abort), and ranks probing at
    once would time each other's load rather than their own.
    """
    if device.type != "cpu":
        return None
    fixed = fixed_threads()
    if fixed is not None:
        torch.set_num_threads(fixed)
        return None
    if local_ranks > 1:
        torch.set_num_threads(max(1, usable_cores() // local_ranks))
        return None
    chooser = ThreadChooser()
    return chooser if chooser.enabled else None


@contextmanager
def step(chooser: ThreadChooser | None, units: float = 1.0) -> Iterator[Work]:
    """`chooser.step(units)`, or just the `Work` when there is no chooser."""
    if chooser is None:
        yield Work(units)
        return
    with chooser.step(units) as work:
        yield work
