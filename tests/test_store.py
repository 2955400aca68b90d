import json
import os

import pytest

from draftflow.contracts import Manifest, ShardEntry
from draftflow.kept import kept_answer
from draftflow.store import Store, shard_entry, stage_fingerprint


def test_writing_commits_atomically_and_cleans_up_on_error(tmp_path):
    store = Store(str(tmp_path))
    dest = store.path("stage", "fp", "a.bin")
    with pytest.raises(RuntimeError):
        with store.writing(dest) as tmp:
            open(tmp, "wb").write(b"half")
            raise RuntimeError("crash mid-write")
    assert not os.path.exists(dest)
    assert os.listdir(os.path.dirname(dest)) == []  # no temp file left behind
    with store.writing(dest) as tmp:
        open(tmp, "wb").write(b"whole")
    assert open(dest, "rb").read() == b"whole"


def _manifest(entry):
    """A complete manifest (`contracts.Manifest`) listing one shard."""
    return Manifest(stage="s", fingerprint="fp", code_version="c", config={}, inputs={}, shards=(entry,),
                    rows_in=1, rows_out=1, dropped={}, tokens=0)


def test_manifest_is_the_completion_marker_and_verifies_shards(tmp_path):
    store = Store(str(tmp_path))
    assert store.read_manifest("s", "fp") is None
    with store.writing(store.stage_path("s", "fp", "x.txt")) as tmp:
        open(tmp, "w").write("data")
        entry = shard_entry("x.txt", tmp, rows=1)
    store.write_manifest("s", "fp", _manifest(entry))
    assert store.read_manifest("s", "fp").shards[0].sha256 == entry.sha256
    # A corrupted shard (same size) or a truncated one makes the stage incomplete again.
    open(store.stage_path("s", "fp", "x.txt"), "w").write("dada")
    assert store.read_manifest("s", "fp") is None
    open(store.stage_path("s", "fp", "x.txt"), "w").write("da")
    assert store.read_manifest("s", "fp") is None


def test_manifest_refuses_to_list_a_missing_shard(tmp_path):
    from draftflow.errors import StoreError

    store = Store(str(tmp_path))
    entry = ShardEntry(name="gone.parquet", rows=1, bytes=3, sha256="0" * 64)
    with pytest.raises(StoreError, match="missing"):
        store.write_manifest("s", "fp", _manifest(entry))
    assert not os.path.exists(store.stage_path("s", "fp", "manifest.json"))


def test_checksum_mismatch_is_detected(tmp_path):
    from draftflow.errors import StoreError

    store = Store(str(tmp_path))
    with store.writing(store.stage_path("s", "fp", "x.txt")) as tmp:
        open(tmp, "w").write("abcd")
        entry = shard_entry("x.txt", tmp, rows=1)
    open(store.stage_path("s", "fp", "x.txt"), "w").write("abce")  # same size, other bytes
    with pytest.raises(StoreError, match="checksum"):
        store.verify_sha("s", "fp", entry)


def test_fingerprint_depends_on_config_inputs_and_nothing_else():
    base = stage_fingerprint("tokenize", {"tokenize": {"max_length": 8}}, {"regenerate": "a"})
    assert base == stage_fingerprint("tokenize", {"tokenize": {"max_length": 8}}, {"regenerate": "a"})
    assert base != stage_fingerprint("tokenize", {"tokenize": {"max_length": 9}}, {"regenerate": "a"})
    assert base != stage_fingerprint("tokenize", {"tokenize": {"max_length": 8}}, {"regenerate": "b"})
    assert base != stage_fingerprint("extract", {"tokenize": {"max_length": 8}}, {"regenerate": "a"})
    json.dumps(base)


def test_committed_files_follow_the_umask_not_mkstemps_0600(tmp_path):
    """A serving job or a teammate under another uid must be able to read a run (0644 under umask 022)."""
    import stat

    from draftflow.store import shared_mode

    store = Store(str(tmp_path))
    store.write_json(store.stage_path("s", "fp", "a.json"), {"a": 1})
    mode = stat.S_IMODE(os.stat(store.stage_path("s", "fp", "a.json")).st_mode)
    assert mode == shared_mode() == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_kept_answer_is_computed_once_per_key_and_a_failure_or_an_unwritable_cache_keeps_nothing(
        tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTFLOW_CACHE", str(tmp_path / "cache"))
    calls = []

    def compute(answer="42"):
        calls.append(answer)
        return answer

    assert kept_answer("answers", "the key", compute) == "42"
    assert kept_answer("answers", "the key", lambda: compute("other")) == "42"  # kept: not computed again
    assert calls == ["42"] and len(list((tmp_path / "cache" / "answers").iterdir())) == 1
    assert kept_answer("answers", "another key", lambda: compute("7")) == "7"

    def fail():
        raise ValueError("the check failed")

    with pytest.raises(ValueError, match="the check failed"):
        kept_answer("answers", "a failing key", fail)
    assert len(list((tmp_path / "cache" / "answers").iterdir())) == 2  # nothing kept for it, no temporary file

    (tmp_path / "file").write_text("not a folder")  # a cache that cannot be written: computed every time
    monkeypatch.setenv("DRAFTFLOW_CACHE", str(tmp_path / "file" / "cache"))
    assert kept_answer("answers", "the key", lambda: compute("9")) == "9"
    assert kept_answer("answers", "the key", lambda: compute("9")) == "9"
    assert calls == ["42", "7", "9", "9"]
