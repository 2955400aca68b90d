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
from draftflow.errors import ConfigError
from draftflow.stages import curate
from draftflow.store import Store
from tests.conftest import stamped

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


def one_line(x): """{LONG}"""; return x


def shares_a_line(x):
    """{LONG}"""; return x


def fenced(x):
    """{LONG}

    ```python
    fenced(1)
    ```
    """


def not_first(x):
    x += 1
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
    # ast counts lines at "\n" only: a form feed above a function must not shift its stub
    assert list(code_stubs.stubs_in("import os\n\x0c\n" + MODULE, CodeStubsConfig(count=9, min_doc_chars=40))) == stubs


def test_files_are_read_as_python_reads_them_and_private_ones_are_left_out(tmp_path):
    (tmp_path / "_private.py").write_text(MODULE)
    (tmp_path / "_inner").mkdir()
    (tmp_path / "_inner" / "mod.py").write_text(MODULE)
    (tmp_path / "bom.py").write_bytes(b"\xef\xbb\xbf" + MODULE.encode())
    latin = MODULE.replace("None", "N\xf6ne").encode("latin-1")
    (tmp_path / "latin.py").write_bytes(b"# -*- coding: latin-1 -*-\n" + latin)
    files = code_stubs.python_files(tmp_path)
    assert [f.name for f in files] == ["bom.py", "latin.py"]
    cfg = CodeStubsConfig(count=9, min_doc_chars=40)
    assert [len(list(code_stubs.stubs_in(code_stubs.read_source(f), cfg))) for f in files] == [2, 2]


def test_choose_is_a_seeded_order_independent_of_file_order():
    stubs = [f"def f{i}():\n    '''doc'''\n" for i in range(50)]
    first = code_stubs.choose(stubs, 10, seed=0)
    assert first == code_stubs.choose(stubs[::-1], 10, seed=0)
    assert first != code_stubs.choose(stubs, 10, seed=1) and len(set(first)) == 10


def test_the_prompts_file_asks_as_humaneval_does_and_is_named_by_its_content(tmp_path, monkeypatch):
    name = _pkg(tmp_path, monkeypatch, "stubpkg", {"a.py": MODULE, "tests/test_a.py": MODULE.replace("sum_", "t_"),
                                                  "b.py": "def broken(:\n"})
    cfg = CodeStubsConfig(count=5, packages=[name], min_doc_chars=40)
    path = code_stubs.prompts_file(cfg, "code", tmp_path / "cache")
    prompts = _prompts(path)
    assert len(prompts) == 2 and all(p.startswith(HUMANEVAL_ASK.split("{")[0]) for p in prompts)
    assert any("def sum_squares(values: list[int]) -> int:" in p for p in prompts)  # tests/ is left out:
    assert not any("t_squares" in p for p in prompts)
    written = Path(path).stat().st_mtime_ns
    assert code_stubs.prompts_file(cfg, "code", tmp_path / "cache") == path  # same content, same file, untouched
    assert Path(path).stat().st_mtime_ns == written
    other = code_stubs.prompts_file(cfg.model_copy(update={"count": 1}), "code", tmp_path / "cache")
    assert other != path and len(_prompts(other)) == 1


def test_the_standard_library_gives_hundreds_of_stubs():
    stubs = code_stubs.collect(CodeStubsConfig(count=1))
    assert len(stubs) > 300 and all(s.startswith(("def ", "async def ")) for s in stubs)


def test_bad_packages_are_one_line(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="source 'code': code_stubs.packages names no_such_pkg_xyz, which is not"
                       ) as missing:
        code_stubs.prompts_file(CodeStubsConfig(count=1, packages=["no_such_pkg_xyz"]), "code", tmp_path)
    name = _pkg(tmp_path, monkeypatch, "emptypkg", {"a.py": "X = 1\n"})
    with pytest.raises(ConfigError, match="source 'code': no public function with a docstring") as empty:
        code_stubs.prompts_file(CodeStubsConfig(count=1, packages=[name]), "code", tmp_path)
    assert "\n" not in str(missing.value) + str(empty.value)
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
    assert Path(cfg.curate.sources[0].generated).name in curate.source_keys(cfg.curate)["code"]
    m = curate.run(Store(cfg.root), stamped("curate", "fp", inputs), cfg)
    rows = [r for s in m.shards for r in read_rows(f"{cfg.root}/curate/fp/{s.name}")]
    train = [r["messages"][0]["content"] for r in rows if r["source"] == "code"]
    assert len(train) == 1 and "cached_twice" in train[0]  # the stub equal to the eval prompt went
    assert m.extra["sources"]["code"]["kept"] == 1


def test_curate_keys_a_stubs_source_by_its_prompts_not_by_where_they_lie(tmp_path, monkeypatch):
    name = _pkg(tmp_path, monkeypatch, "keypkg", {"a.py": MODULE})

    def inputs(cache: str, **stubs) -> dict[str, str]:
        monkeypatch.setenv("DRAFTFLOW_CACHE", str(tmp_path / cache))
        cfg = load_config(None, [f"root={tmp_path}"])
        src = SourceConfig(name="code", code_stubs=CodeStubsConfig(packages=[name], min_doc_chars=40, **stubs))
        return curate.source_fingerprint_inputs(cfg.model_copy(update={"curate": CurateConfig(sources=[src])}))

    first = inputs("a", count=2)
    assert inputs("b", count=2) == first  # another cache (a wiped one, another machine): the same key
    assert inputs("a", count=1) != first
