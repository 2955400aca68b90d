"""draftflow.progress: parts add up, listeners are rate-limited, a failing listener never fails the work."""

from __future__ import annotations

import pytest

from draftflow import progress


@pytest.fixture
def heard():
    got: list[progress.Progress] = []
    progress.add_sink("test", got.append, interval=3600.0)  # only first, forced and final reports get through
    yield got
    progress.remove_sink("test")


def test_parallel_parts_add_up_to_the_stage_and_the_final_report_is_heard(heard):
    progress.begin("stage-a", total=30)
    progress.report("stage-a", 5, 10, part="s0")
    progress.report("stage-a", 10, 20, part="s1")
    progress.report("stage-a", 10, 10, part="s0")  # absolute counts: a repeat replaces, never adds
    assert progress.snapshot("stage-a").done == 20 and progress.snapshot("stage-a").total == 30
    assert [p.done for p in heard] == [0]  # rate-limited: only the first report so far
    progress.report("stage-a", 20, 20, part="s1")
    assert [p.done for p in heard] == [0, 30] and heard[-1].finished and heard[-1].eta == 0.0
    progress.report("stage-a", 20, 20, part="s1")
    assert len(heard) == 2  # the end is heard once


def test_skipped_parts_count_as_done_but_not_as_speed(heard, monkeypatch):
    progress.begin("stage-b", total=100)
    progress.report("stage-b", 90, 90, part="cached", skipped=True)
    snap = progress.snapshot("stage-b")
    assert snap.done == 90 and snap.rate is None and snap.eta is None
    progress.report("stage-b", 5, 10, part="live")
    assert progress.snapshot("stage-b").rate is None  # too early for a speed (MIN_RATE_SECONDS)
    monkeypatch.setattr(progress, "MIN_RATE_SECONDS", 0.0)
    assert progress.snapshot("stage-b").rate is not None


def test_a_new_run_of_a_finished_stage_is_a_new_session(heard):
    progress.report("stage-c", 4, 4, unit="steps")
    first = progress.snapshot("stage-c").session
    progress.report("stage-c", 1, 4, unit="steps")
    again = progress.snapshot("stage-c")
    assert again.session != first and again.done == 1 and again.unit == "steps"
    assert [(p.session, p.done) for p in heard] == [(first, 4), (again.session, 1)]


def test_a_failing_listener_is_switched_off_and_the_work_goes_on(caplog):
    def broken(p):
        raise ConnectionError("api down")

    progress.add_sink("broken", broken, interval=0.0)
    progress.report("stage-d", 1, 2)
    progress.report("stage-d", 2, 2)  # no exception reaches the caller
    assert "progress listener broken failed" in caplog.text and caplog.text.count("api down") == 1


def test_line_reads_like_a_progress_bar():
    p = progress.Progress("regenerate", 120, 444, "rows", elapsed=4.0, rate=30.0, session=1)
    assert p.line() == "regenerate 120/444 rows (27%), 30 rows/s, ETA 11 s"
    done = progress.Progress("train", 24, 24, "steps", elapsed=125.0, rate=0.19, session=2)
    assert done.line() == "train 24/24 steps (100%), 0.19 steps/s, 2.1 min"


def test_phases_report_each_end_keep_their_times_in_order_and_read_as_one_line(heard, monkeypatch, caplog):
    now = [100.0]  # the clock moves only where the test moves it
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    phases = progress.Phases("stage-p", ["decode", "ddtree", "vllm"])
    with caplog.at_level("INFO", logger="draftflow.progress"):
        now[0] = 103.5
        phases.done("decode")
        phases.done("ddtree")
        now[0] = 250.0
        phases.done("vllm")
    assert phases.seconds == {"decode": 3.5, "ddtree": 0.0, "vllm": 146.5}
    assert list(phases.seconds) == ["decode", "ddtree", "vllm"]
    assert progress.phase_line(phases.seconds) == "decode 4 s, ddtree 0 s, vllm 2.4 min"
    assert heard[-1].stage == "stage-p" and heard[-1].unit == "phases" and (heard[-1].done, heard[-1].total) == (3, 3)
    assert "stage-p: vllm took 2.4 min" in caplog.text


def test_a_phase_says_how_far_it_got_and_phases_draw_no_eta(monkeypatch):
    """Evaluate counted 4 phases, then was silent for 12 minutes after an "ETA 4.9 min": inside a phase the loop
    now says how far it got, and a count of unlike phases gives no ETA."""
    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    phases = progress.Phases("stage-w", ["decode", "ddtree"])
    now[0] = 30.0
    progress.within("stage-w", 3, 24, "prompts")
    line = progress.snapshot("stage-w").line()
    assert line.startswith("stage-w 0/2 phases (0%)") and line.endswith("decode 3/24 prompts") and "ETA" not in line
    phases.done("decode")
    now[0] = 40.0
    progress.within("stage-w", 1, 4, "tree decodes")
    assert progress.snapshot("stage-w").line().endswith("ddtree 1/4 tree decodes") and "ETA" not in line
    phases.done("ddtree")
    assert progress.snapshot("stage-w").note == "" and "stage-w" not in progress._phases
    progress.within("stage-w", 1, 2, "prompts")  # no phases kept for the stage any more: nothing happens
    assert progress.snapshot("stage-w").note == ""


def test_a_counted_phase_follows_its_units_across_functions_and_drops_those_not_run(monkeypatch):
    """evaluate's vLLM phase: `count` plans the engine runs, each `tick` is one, `fewer` drops planned runs the
    serve choice does not need; the next phase starts uncounted."""
    phases = progress.Phases("stage-c", ["baselines", "vllm", "last"])
    progress.tick("stage-c")  # nothing counted yet: no note
    assert progress.snapshot("stage-c").note == ""
    phases.done("baselines")
    progress.count("stage-c", 6, "vLLM engine runs")
    assert progress.snapshot("stage-c").line().endswith("vllm 0/6 vLLM engine runs")
    progress.tick("stage-c")
    progress.tick("stage-c")
    assert progress.snapshot("stage-c").note == "vllm 2/6 vLLM engine runs"
    progress.tick("stage-c", fewer=3)  # the choice serves one setting of the three planned
    assert progress.snapshot("stage-c").note == "vllm 2/3 vLLM engine runs"
    progress.tick("stage-c", fewer=5)  # never fewer than done
    assert progress.snapshot("stage-c").note == "vllm 2/2 vLLM engine runs"
    phases.done("vllm")
    progress.tick("stage-c")  # the count ended with its phase
    assert progress.snapshot("stage-c").note == ""
