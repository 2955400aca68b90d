"""The torch thread count of CPU loops is measured on the loop's own steps (`draftflow.training.threads`).

The choice is tested with fixed step costs (a fake clock), never with timings of this machine.
"""

from __future__ import annotations

import pytest
import torch

from draftflow.errors import ConfigError
from draftflow.training import threads


class FakeMachine:
    """A clock and a thread setter: each step costs `cost[threads]` seconds per unit."""

    def __init__(self, cost: dict[int, float]):
        self.cost, self.now, self.threads, self.history = dict(cost), 0.0, None, []

    def clock(self) -> float:
        return self.now

    def set_threads(self, n: int) -> None:
        self.threads = n

    def run(self, chooser: threads.ThreadChooser, steps: int, units: float = 10.0) -> None:
        for _ in range(steps):
            with chooser.step(units):
                self.history.append(self.threads)
                self.now += self.cost[self.threads] * units


def test_candidates_are_powers_of_two_up_to_the_cores():
    assert threads.candidates(1) == [1]
    assert threads.candidates(2) == [1, 2]
    assert threads.candidates(6) == [1, 2, 4, 6]
    assert threads.candidates(8) == [1, 2, 4, 8]


def test_a_busy_core_makes_one_thread_the_choice():
    m = FakeMachine({1: 0.02, 2: 0.7})  # beside a burner: 2 threads 35x slower (measured here: 34x)
    c = threads.ThreadChooser(cores=2, probe_steps=3, reprobe_s=1e9, clock=m.clock, set_threads=m.set_threads)
    m.run(c, 40)
    assert c.chosen == 1
    # one warm-up step, 3 probe steps per candidate, then the choice for every step after
    assert m.history[:7] == [1, 1, 1, 1, 2, 2, 2]
    assert set(m.history[7:]) == {1}


def test_large_ops_on_free_cores_choose_every_core():
    m = FakeMachine({1: 0.10, 2: 0.055, 4: 0.03})
    c = threads.ThreadChooser(cores=4, probe_steps=2, reprobe_s=1e9, clock=m.clock, set_threads=m.set_threads)
    m.run(c, 20)
    assert c.chosen == 4 and m.history[-1] == 4


def test_steps_of_other_sizes_compare_per_unit_of_work():
    m = FakeMachine({1: 0.01, 2: 0.006})
    c = threads.ThreadChooser(cores=2, probe_steps=1, reprobe_s=1e9, clock=m.clock, set_threads=m.set_threads)
    m.run(c, 2, units=10)  # warm-up + the probe of 1 thread on a short step
    m.run(c, 1, units=1000)  # the probe of 2 threads on a long one: slower in seconds, faster per unit
    assert c.chosen == 2


def test_load_that_arrives_mid_run_is_noticed_at_the_next_probe():
    m = FakeMachine({1: 0.02, 2: 0.012})
    c = threads.ThreadChooser(cores=2, probe_steps=2, reprobe_s=5.0, clock=m.clock, set_threads=m.set_threads)
    m.run(c, 10)
    assert c.chosen == 2
    m.cost[2] = 0.5  # another job took a core
    m.run(c, 60)
    assert c.chosen == 1 and [ch for ch, _ in c.choices][:2] == [2, 1]


def test_probes_take_a_bounded_share_of_a_loop_whose_steps_are_long():
    # evaluate's steps are whole prompts: 13 s a prompt at one thread, and beside other work 2 threads spin (x10);
    # a probe (3 steps at each count) then costs ~430 s, far over reprobe_s, and must not start again at once
    m = FakeMachine({1: 1.3, 2: 13.0})
    c = threads.ThreadChooser(cores=2, probe_steps=3, reprobe_s=60.0, clock=m.clock, set_threads=m.set_threads)
    m.run(c, 700)
    probe_s = 3 * 13.0 + 3 * 130.0  # one probe: 3 prompts at each count
    assert c.chosen == 1 and len(c.choices) >= 2  # it still probes again, later
    # every probe but the last was followed by its choice for at least (1 - share) / share of its own time
    assert (len(c.choices) - 1) * probe_s <= threads.PROBE_SHARE * m.now, (len(c.choices), m.now)


def test_ties_go_to_fewer_threads_and_one_core_never_probes():
    m = FakeMachine({1: 0.01, 2: 0.01})
    c = threads.ThreadChooser(cores=2, probe_steps=1, reprobe_s=1e9, clock=m.clock, set_threads=m.set_threads)
    m.run(c, 5)
    assert c.chosen == 1
    solo = threads.ThreadChooser(cores=1, clock=m.clock, set_threads=m.set_threads)
    assert not solo.enabled


def test_the_environment_fixes_the_count_and_turns_the_probe_off(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv(threads.ENV, "1")
        assert threads.chooser_for(torch.device("cpu")) is None and torch.get_num_threads() == 1
        monkeypatch.setenv(threads.ENV, "two")
        with pytest.raises(ConfigError, match="DRAFTFLOW_TORCH_THREADS='two'"):
            threads.chooser_for(torch.device("cpu"))
        monkeypatch.delenv(threads.ENV)
        assert threads.chooser_for(torch.device("meta")) is None  # not a CPU loop
    finally:
        torch.set_num_threads(before)


def test_ranks_sharing_a_machine_split_its_cores_once_and_never_probe(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv(threads.ENV, raising=False)
        monkeypatch.setattr(threads, "usable_cores", lambda: 8)
        assert threads.chooser_for(torch.device("cpu"), local_ranks=4) is None and torch.get_num_threads() == 2
        assert threads.chooser_for(torch.device("cpu"), local_ranks=16) is None and torch.get_num_threads() == 1
        assert threads.chooser_for(torch.device("cpu"), local_ranks=1).candidates == [1, 2, 4, 8]
    finally:
        torch.set_num_threads(before)
