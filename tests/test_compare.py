"""`draftflow compare RUN...`: the table across evaluations (old reports without the newer keys too),
the PNG, what a RUN can be, and that it answers without torch or Prefect."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftflow.runs.compare import baselines, compare, figures, legend_label, table_rows
from draftflow.runs.evalruns import Evaluation, NoEvaluation, resolve
from tests.test_gate import evaluation

STATS = {"acceptance_rate": [0.5], "accept_histogram": [0, 1, 1], "steps": 2, "tokens": 4, "prompts": 1}
NEW = {
    "tau": 2.75,
    **STATS,
    "categories": {"chat": {"tau": 2.5, **STATS}, "code": {"tau": 3.25, **STATS}, "math": {"tau": 2.0, **STATS}},
    "baselines": {"no_draft": {"tau": 1.0, **STATS}, "prompt_lookup": {"tau": 1.4, **STATS}},
    "speedup": {"target_step_s": 0.02, "predicted": 1.93, "drafter_setting": "dflash:k=3", "device": "cpu"},
    "ddtree": {
        "16": {"tau": 3.5, "steps": 2, "nodes": 16},
        "4": {"tau": 3.0, "steps": 2, "nodes": 4},
        "1": {"tau": 2.75, "steps": 2, "nodes": 1},
    },
}
OLD = {"tau": 2.125, "tau_per_prompt": [2.125], **STATS}  # written before categories, baselines, speedup, ddtree


def write(path: Path, report: dict) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report))
    return str(path)


def test_figures_read_every_key_the_report_has_and_skip_the_absent_ones():
    assert figures(OLD) == {"tau": 2.125}
    got = figures(NEW)
    assert list(got) == [
        "tau",
        "speedup (predicted)",
        "tau chat",
        "tau code",
        "tau math",
        "tau baseline no_draft",
        "tau baseline prompt_lookup",
        "tau ddtree 1",
        "tau ddtree 4",
        "tau ddtree 16",
    ]
    assert got["tau code"] == 3.25 and got["tau ddtree 16"] == 3.5 and got["speedup (predicted)"] == 1.93


def test_table_of_two_report_files_shows_each_figure_and_a_dash_where_a_report_lacks_it(tmp_path):
    a, b = write(tmp_path / "a" / "report.json", NEW), write(tmp_path / "b" / "report.json", OLD)
    text = compare([a, b])
    lines = text.splitlines()
    assert lines[0] == f"[1] {a}  {tmp_path / 'a'}" and lines[1] == f"[2] {b}  {tmp_path / 'b'}"
    rows = {line.split("  ")[0].strip(): line.split()[-2:] for line in lines[3:]}
    assert rows["tau"] == ["2.750", "2.125"]
    assert rows["speedup (predicted)"] == ["x1.93", "-"]
    assert rows["tau math"] == ["2.000", "-"] and rows["tau baseline prompt_lookup"] == ["1.400", "-"]
    assert [n for n in rows if n.startswith("tau ddtree")] == ["tau ddtree 1", "tau ddtree 4", "tau ddtree 16"]
    assert rows["gate"] == ["-", "-"]


def test_png_is_written_with_baselines_and_readable_names(tmp_path):
    a, b = write(tmp_path / "a.json", NEW), write(tmp_path / "b.json", OLD)
    text = compare([a, b], png=str(tmp_path / "out" / "cmp.png"))
    png = tmp_path / "out" / "cmp.png"
    assert text.endswith(f"plot: {png}") and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert baselines([figures(OLD), figures(NEW)]) == {"no_draft": 1.0, "prompt_lookup": 1.4}
    from draftflow.contracts import Manifest

    m = Manifest(stage="evaluate", fingerprint="6ce8a7853126c3a4", code_version="c", inputs={}, shards=(),
                 config={"drafter": {"kind": "eagle3"}}, rows_in=1, rows_out=1, dropped={}, tokens=0)
    run = Evaluation("tiny/6ce8a7853126c3a4", "/r/evaluate/6ce8a7853126c3a4", NEW, "6ce8a7853126c3a4", m)
    assert legend_label(2, run, figures(NEW)) == "[2] tiny · eagle3 · 6ce8a785 (x1.93)"
    assert legend_label(1, Evaluation(a, a, OLD), figures(OLD)) == f"[1] {a}"


def test_a_run_root_gives_each_evaluation_in_it_and_an_evaluate_folder_gives_one(tmp_path):
    evaluation(tmp_path / "run", "a" * 16, 2.5)
    evaluation(tmp_path / "run", "b" * 16, None)  # no drafting step measured: τ n/a
    both = resolve(str(tmp_path / "run"))
    assert [e.fingerprint for e in both] == ["a" * 16, "b" * 16] and both[0].label == f"run/{'a' * 16}"
    one = resolve(str(tmp_path / "run" / "evaluate" / ("b" * 16)))
    assert [e.fingerprint for e in one] == ["b" * 16] and one[0].manifest is not None
    names, cells = table_rows(both)
    assert dict(zip(names, cells))["tau"] == ["2.500", "-"]
    (tmp_path / "run" / "evaluate" / ("a" * 16) / "gate.json").write_text(json.dumps({"promoted": True}))
    names, cells = table_rows(resolve(str(tmp_path / "run")))
    assert dict(zip(names, cells))["gate"] == ["promoted", "-"]


def test_a_run_that_holds_no_evaluation_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    for bad in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(NoEvaluation, match=f"no evaluation at {bad}: pass a run root") as exc:
            resolve(str(bad))
        assert "\n" not in str(exc.value)


def test_compare_cli_answers_without_torch_or_prefect(tmp_path):
    from tests.test_runstate import cli_imports

    a, b = write(tmp_path / "a.json", NEW), write(tmp_path / "b.json", OLD)
    got, proc = cli_imports("compare", a, b)
    assert got == {"rc": 0, "heavy": []}, proc.stderr
    assert "tau ddtree 16" in proc.stdout
    got, proc = cli_imports("compare", str(tmp_path / "missing"))
    assert got == {"rc": 2, "heavy": []} and proc.stderr.count("\n") == 1 and "no evaluation at" in proc.stderr


CHOICE = {"1": {"setting": "dflash:k=2", "predicted": 1.55, "measured": 1.5},
          "8": {"setting": "plain", "predicted": 1.0, "measured": 1.0}}
SERVED = {"batches": [1, 8], "choice": CHOICE, "methods": {
    "dflash": {"speedup": {"1": 1.62, "8": 1.08}, "tau": 2.4},
    "prompt_lookup": {"speedup": {"1": 1.1, "8": 0.97}, "tau": 1.3}}}


def test_rehearsal_line_pairs_the_recipes_and_reads_the_chosen_settings(tmp_path):
    from draftflow.runs.compare import rehearsal_line

    report = NEW | {"vllm": {"vllm": {"tau": 2.71}, "speculators": {"tau": 2.7}}, "served": SERVED,
                    "kind": "dflash", "recipe": "draftflow", "prompt_set": "p"}
    paper = NEW | {"tau": 2.2, "kind": "dflash", "recipe": "paper", "prompt_set": "p"}
    line = rehearsal_line(report, paper)
    assert line == ("rehearsal dflash: tau 2.750 paper_tau 2.200 vllm_tau 2.710 prompt_lookup_tau 1.400 "
                    "serve_b1 dflash:k=2 predicted_b1 1.550 speedup_b1 1.500 serve_b8 plain speedup_b8 1.000")
    words = line.split()
    assert dict(zip(words[2::2], words[3::2]))["serve_b8"] == "plain"  # as scripts read it
    assert rehearsal_line(NEW) is None  # no served record: no line
    assert "paper_tau nan" in rehearsal_line(report)
    assert figures(report)["speedup served b8 prompt_lookup"] == 0.97 and figures(report)["tau vllm"] == 2.71
    text = compare([write(tmp_path / "r" / "report.json", report), write(tmp_path / "p" / "report.json", paper)],
                   lines=True)
    assert text.splitlines()[-1] == line  # one line, for the draftflow recipe's evaluation, with its paper pair
