"""Per-stage code hashes: a stage's fingerprint follows the code it imports, and only that."""

from __future__ import annotations

import re
from pathlib import Path

from draftflow import codehash
from draftflow.codehash import closure, source_hash
from draftflow.stages.registry import stage_names


def _pkg(tmp_path: Path) -> Path:
    root = tmp_path / "draftflow"
    files = {
        "__init__.py": "",
        "store.py": "import os\n",
        "data/__init__.py": "from draftflow.data.schema import X\n",
        "data/schema.py": "X = 1\n",
        "models/__init__.py": "",
        "models/net.py": "from ..store import *\n",
        "stages/__init__.py": "",
        "stages/curate.py": "from draftflow.data import schema\nfrom draftflow import store\n",
        "stages/train.py": "def f():\n    from .common import g\n    from draftflow.models.net import N\n",
        "stages/common.py": "import draftflow.store\n",
        "assets/data.txt": "bundled\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def _names(root: Path, module: str) -> set[str]:
    return {str(p.relative_to(root)) for p in closure(root, module)}


def test_closure_follows_absolute_relative_and_function_level_imports(tmp_path):
    root = _pkg(tmp_path)
    assert _names(root, "draftflow.stages.curate") == {
        "__init__.py", "stages/__init__.py", "stages/curate.py", "data/__init__.py", "data/schema.py", "store.py"}
    assert _names(root, "draftflow.stages.train") == {
        "__init__.py", "stages/__init__.py", "stages/train.py", "stages/common.py", "store.py",
        "models/__init__.py", "models/net.py"}


def test_a_files_imports_are_parsed_once_a_machine_and_follow_its_bytes_not_its_mtime(tmp_path, monkeypatch):
    """The parse is kept on disk under the file's bytes: a later process reads it, and an edit that keeps the size
    and the mtime (a copy that preserved them, a clock step) still changes what the closure finds."""
    import os

    monkeypatch.setenv("DRAFTFLOW_CACHE", str(tmp_path / "cache"))
    root = _pkg(tmp_path)
    codehash._imported_version.cache_clear()  # as a new process starts
    assert "models/net.py" in _names(root, "draftflow.stages.train")
    assert len(list((tmp_path / "cache" / "code-imports").iterdir())) == 7  # one per module file reached

    def no_parse(*args, **kwargs):
        raise AssertionError("parsed again")

    codehash._imported_version.cache_clear()
    monkeypatch.setattr(codehash.ast, "parse", no_parse)
    assert "models/net.py" in _names(root, "draftflow.stages.train")  # every answer from the disk
    monkeypatch.undo()
    monkeypatch.setenv("DRAFTFLOW_CACHE", str(tmp_path / "cache"))

    train = root / "stages/train.py"
    st = train.stat()
    edited = train.read_text().replace("draftflow.models.net import N", "draftflow.data import schema ")
    assert len(edited) == st.st_size
    train.write_text(edited)
    os.utime(train, ns=(st.st_atime_ns, st.st_mtime_ns))
    codehash._imported_version.cache_clear()
    assert "models/net.py" not in _names(root, "draftflow.stages.train")
    assert "data/schema.py" in _names(root, "draftflow.stages.train")


def _hash(root: Path, module: str) -> str:
    return source_hash(root, closure(root, module))


def test_an_edit_changes_only_the_stages_that_import_it(tmp_path):
    root = _pkg(tmp_path)
    before = {m: _hash(root, f"draftflow.stages.{m}") for m in ("curate", "train")}
    (root / "models/net.py").write_text("from ..store import *\nN = 2\n")
    assert _hash(root, "draftflow.stages.curate") == before["curate"]
    assert _hash(root, "draftflow.stages.train") != before["train"]
    (root / "store.py").write_text("import os  # shared by both\n")
    assert _hash(root, "draftflow.stages.curate") != before["curate"]
    h1 = _hash(root, "draftflow.stages.curate")
    (root / "assets/data.txt").write_text("changed\n")  # bundled data counts for every stage
    assert _hash(root, "draftflow.stages.curate") != h1


def test_real_stages_see_their_own_code_and_not_the_trainer():
    curate = {str(p.relative_to(codehash.ROOT)) for p in closure(codehash.ROOT, "draftflow.stages.curate")}
    train = {str(p.relative_to(codehash.ROOT)) for p in closure(codehash.ROOT, "draftflow.stages.train")}
    assert {"data/filters.py", "data/dedup.py", "stages/curate.py"} <= curate
    assert not any(p.startswith(("models/", "training/")) for p in curate)
    assert {"training/loop.py", "training/job.py", "drafters/batches.py", "drafters/dflash/model.py",
            "drafters/eagle3/objective.py", "stages/train.py"} <= train


def test_a_kinds_files_count_for_the_stages_that_load_them_by_name(tmp_path):
    """A kind's model is imported by name (the drafter registry), yet an edit to it changes train's code hash and
    not extract's; an edit to its data rule changes both."""
    import shutil

    root = tmp_path / "draftflow"
    shutil.copytree(codehash.ROOT, root, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    before = {s: _hash(root, f"draftflow.stages.{s}") for s in ("extract", "train")}
    with (root / "drafters/eagle3/model.py").open("a") as f:
        f.write("# an edit\n")
    after = {s: _hash(root, f"draftflow.stages.{s}") for s in ("extract", "train")}
    assert after["extract"] == before["extract"] and after["train"] != before["train"]
    with (root / "drafters/eagle3/taps.py").open("a") as f:
        f.write("# an edit\n")
    assert _hash(root, "draftflow.stages.extract") != after["extract"]
    train = _hash(root, "draftflow.stages.train")
    (root / "drafters/wip").mkdir()  # a kind folder not (yet) in KINDS changes nothing
    (root / "drafters/wip/spec.py").write_text("SPEC = None\n")
    (root / "drafters/wip/taps.py").write_text("RULE = None\n")
    assert _hash(root, "draftflow.stages.train") == train


def test_the_data_stages_see_each_kinds_data_rule_and_nothing_else_of_it():
    """Tokenize and extract read every kind's light rule (`drafters/<kind>/taps.py`) and its own settings (the
    config validates them: `<kind>/settings.py`); an edit to a kind's model, objective or export must not recompute
    them."""
    for stage in ("tokenize", "extract"):
        files = {str(p.relative_to(codehash.ROOT)) for p in closure(codehash.ROOT, f"draftflow.stages.{stage}")}
        assert {"drafters/taps.py", "drafters/dflash/taps.py", "drafters/eagle3/taps.py"} <= files, stage
        drafters = {p for p in files if p.startswith("drafters/")}
        light = {"drafters/__init__.py", "drafters/taps.py", "drafters/rule.py"}
        own = ("/taps.py", "/settings.py", "/__init__.py")
        assert all(p in light or p.endswith(own) for p in drafters), (stage, drafters)
        assert not any(p.startswith(("models/", "training/")) for p in files), stage


def test_library_imports_no_module_by_computed_name():
    """`closure` reads import statements; a module loaded by a string name would be missed."""
    pattern = re.compile(r"import_module\(|__import__\(|importlib\.util\.spec_from")
    offenders = [str(p.relative_to(codehash.ROOT)) for p in codehash.ROOT.rglob("*.py")
                 if pattern.search(p.read_text())]
    # The stage registry imports each stage's module by the stage's name; no stage imports the registry, so no
    # stage's closure depends on that edge. The drafter registries import each kind's modules by the kind's
    # name, and `codehash.COMPUTED` names the files they may import; so does the drafter section's validation,
    # which loads each kind's own settings (`config.train.kind_settings`).
    assert sorted(offenders) == ["config/train.py", "drafters/registry.py", "drafters/taps.py", "stages/registry.py"]
    assert {f"draftflow.{p[:-3].replace('/', '.')}" for p in offenders} - set(codehash.COMPUTED) == {
        "draftflow.stages.registry"}
    stage_closures = [closure(codehash.ROOT, f"draftflow.stages.{s}") for s in stage_names()]
    assert not any(codehash.ROOT / "stages/registry.py" in c for c in stage_closures)


def test_library_versions_enter_the_stages_they_shape_as_a_fingerprint_input():
    from draftflow.config import RunConfig
    from draftflow.stages.registry import spec, stage_inputs, stage_names

    cfg = RunConfig()
    digests = {s: "d" for s in stage_names()}
    assert "libraries" not in stage_inputs(cfg, "curate", None, {})
    tok = stage_inputs(cfg, "tokenize", "t", digests)["libraries"]
    names = [p.split("=")[0] for p in tok.split(";")]
    assert names == list(spec("tokenize").libraries) == ["transformers", "tokenizers"]
    assert "+" not in tok  # no local build tags: 2.13.0+cpu and 2.13.0+cu130 agree
    extract = stage_inputs(cfg, "extract", "t", digests)["libraries"]
    assert extract.startswith("torch=") and "+" not in extract
