"""code_stubs sources: "complete this function" prompts from installed Python code, chosen by seed, cached by
content, curated like any prompt file and kept away from HumanEval by curate's decontamination."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from draftflow.config import CodeStubsConfig, CurateConfig, SourceConfig, load_config
from draftflow.data import code_stubs
from draftflow.data.schema import read_rows
from draftflow.data.sources import HUMANEVAL_ASK
from draftflow.errors import ConfigError, DraftflowError
from draftflow.stages import curate
from draftflow.store import Store

LONG = "Return the sum of the squares of the numbers in values, skipping any that are None or negative."
MODULE = f'''
import functools

def sum_squares(values: list[int]) -> int:
    """{LONG}"""
    return sum(v * v for v in values if v is not None and v >= 0)


def _private(x):
    """{LONG}"""
    return x


def short(x):
    """Too short."""
    return x


@functools.cache
def cached_twice(
    a,
    b=2,
):
    """{LONG}

    >>> cached_twice(1)
    3
    """
    return a + b


class Holder:
    def method(self):
        """{LONG}"""
'''


def _pkg(tmp_path: Path, monkeypatch, name: str, files: dict[str, str]) -> str:
    root = tmp_path / "site" / name
    for rel, text in {"__init__.py": "", **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    sys.modules.pop(name, None)
    return name


def _prompts(path: str) -> list[str]:
    return [json.loads(line)["prompt"] for line in Path(path).read_text().splitlines()]


def test_a_stub_is_the_def_through_its_docstring_of_public_documented_functions():
    stubs = list(code_stubs.stubs_in(MODULE, CodeStubsConfig(count=9, min_doc_chars=40)))
    assert stubs == [
        f'def sum_squares(values: list[int]) -> int:\n    """{LONG}"""\n',
        f'def cached_twice(\n    a,\n    b=2,\n):\n    """{LONG}\n\n    >>> cached_twice(1)\n    3\n    """\n',
    ]
    assert list(code_stubs.stubs_in(MODULE, CodeStubsConfig(count=9, min_doc_chars=40, max_chars=160))) == stubs[:1]
    assert list(code_stubs.stubs_in("def broken(:\n", CodeStubsConfig(count=1))) == []


def test_choose_is_a_seeded_order_independent_of_file_order():
    stubs = [f"def f{i}():\n    '''doc'''\n" for i in range(50)]
    first = code_stubs.choose(stubs, 10, seed=0)
    assert first == code_stubs.choose(stubs[::-1], 10, seed=0)
    assert first != code_stubs.choose(stubs, 10, seed=1) and len(set(first)) == 10


def test_the_prompts_file_asks_as_humaneval_does_and_is_named_by_its_content(tmp_path, monkeypatch):
    name = _pkg(tmp_path, monkeypatch, "stubpkg", {"a.py": MODULE, "tests/test_a.py": MODULE.replace("sum_", "t_"),
                                                  "b.py": "def broken(:\n"})
    cfg = CodeStubsConfig(count=5, packages=[name], min_doc_chars=40)
    path = code_stubs.prompts_file(cfg, tmp_path / "cache")
    prompts = _prompts(path)
    assert len(prompts) == 2 and all(p.startswith(HUMANEVAL_ASK.split("{")[0]) for p in prompts)
    assert any("def sum_squares(values: list[int]) -> int:" in p for p in prompts)  # tests/ is left out:
    assert not any("t_squares" in p for p in prompts)
    assert code_stubs.prompts_file(cfg, tmp_path / "cache") == path  # same content, same file
    other = code_stubs.prompts_file(cfg.model_copy(update={"count": 1}), tmp_path / "cache")
    assert other != path and len(_prompts(other)) == 1


def test_the_standard_library_gives_hundreds_of_stubs():
    stubs = code_stubs.collect(CodeStubsConfig(count=1))
    assert len(stubs) > 300 and all(s.startswith(("def ", "async def ")) for s in stubs)


def test_bad_packages_are_one_line(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="no_such_pkg_xyz, which is not an installed package"):
        code_stubs.prompts_file(CodeStubsConfig(count=1, packages=["no_such_pkg_xyz"]), tmp_path)
    name = _pkg(tmp_path, monkeypatch, "emptypkg", {"a.py": "X = 1\n"})
    with pytest.raises(DraftflowError, match="no public function with a docstring"):
        code_stubs.prompts_file(CodeStubsConfig(count=1, packages=[name]), tmp_path)
    with pytest.raises(ValueError, match="needs exactly one of path, hf, self_instruct or code_stubs"):
        SourceConfig(name="s", path="x.jsonl", code_stubs=CodeStubsConfig(count=1))
    with pytest.raises(ValueError, match="code_stubs writes prompt rows"):
        SourceConfig(name="s", format="alpaca", code_stubs=CodeStubsConfig(count=1))


def test_curate_reads_stubs_as_user_turns_and_drops_an_eval_copy(tmp_path, monkeypatch):
    name = _pkg(tmp_path, monkeypatch, "curpkg", {"a.py": MODULE})
    stubs = CodeStubsConfig(count=5, packages=[name], min_doc_chars=40)
    held = tmp_path / "eval.jsonl"  # an eval prompt that is one of the stubs, asked the same way
    stub = next(code_stubs.stubs_in(MODULE, stubs))
    held.write_text(json.dumps({"prompt": HUMANEVAL_ASK.format(code=stub)}) + "\n")
    cfg = load_config(None, [f"root={tmp_path}"])
    sources = [SourceConfig(name="code", code_stubs=stubs),
               SourceConfig(name="held", path=str(held), format="prompt", split="eval", category="code")]
    cfg = cfg.model_copy(update={"curate": CurateConfig(sources=sources, eval_fraction=0.0)})
    inputs, _ = curate.stage_inputs(cfg)
    assert cfg.curate.sources[0].generated in curate.source_keys(cfg.curate)["code"]
    m = curate.run(Store(cfg.root), "fp", cfg, inputs)
    rows = [r for s in m.shards for r in read_rows(f"{cfg.root}/curate/fp/{s.name}")]
    train = [r["messages"][0]["content"] for r in rows if r["source"] == "code"]
    assert len(train) == 1 and "cached_twice" in train[0]  # the stub equal to the eval prompt went
    assert m.extra["sources"]["code"]["kept"] == 1
