"""A catalogue of bad inputs, each through the real CLI (`flows.cli.main(["run", ...])` in-process).

Every case must end the same way: exit code 2, exactly one stderr line `draftflow: error: ...` that
names what to fix (the field, file or setting), no traceback, and the run root untouched. The root
holds a finished curate stage of the tiny demo (prepared once for the module); its files' hashes are
compared after each case. Most cases stop at config load or preflight, before Prefect starts; the
storage cases replace the pipeline by one that raises the error storage would raise mid-run.
"""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
import struct
import sys
import types
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.reliability
TINY = str(ROOT / "configs" / "tiny.yaml")
SAMPLE = ROOT / "draftflow" / "assets" / "sample_data"


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_target):
    """A run root holding the tiny demo's curate stage, a folder for bad files, and the tiny target."""
    from draftflow.config import load_config
    from draftflow.stages import curate
    from draftflow.stages.registry import stamp
    from draftflow.store import Store

    base = tmp_path_factory.mktemp("bad-inputs")
    root = base / "root"
    cfg = load_config(TINY, [f"root={root}"])
    inputs, tokenizer = curate.stage_inputs(cfg)
    curate.run(Store(cfg.root), stamp(cfg, "curate", inputs), cfg, tokenizer)
    assert list(root.glob("curate/*/manifest.json"))
    files = base / "files"
    files.mkdir()
    return types.SimpleNamespace(root=root, files=files, target=Path(tiny_target.path), snapshot=_hashes(root))


@pytest.fixture(autouse=True)
def no_pipeline(monkeypatch):
    """A bad input must stop before the pipeline: one that gets past preflight fails here, fast, without
    starting Prefect or writing into the prepared root (the storage cases put their own stand-in)."""
    def pipeline(cfg):
        raise AssertionError("the bad input got past preflight: the pipeline started")

    monkeypatch.setitem(sys.modules, "flows.pipeline", types.SimpleNamespace(pipeline=pipeline))


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _run_cli(capsys, prepared, config: str, overrides: list[str]) -> tuple[int, str]:
    from flows.cli import main

    capsys.readouterr()
    args = ["run", config, "--set", f"root={prepared.root}"]
    for o in overrides:
        args += ["--set", o]
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.err


def _assert_one_line(code: int, err: str, expected: list[str], prepared) -> str:
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("draftflow: error:")]
    assert len(lines) == 1, err
    for text in expected:
        assert text in lines[0], lines[0]
    assert _hashes(prepared.root) == prepared.snapshot  # nothing written before was lost or changed
    return lines[0]


# ----------------------------------------------------------------------------- file builders


def _file(name: str, data: bytes):
    def make(p):
        path = p.files / name
        path.write_bytes(data)
        return [f"curate.sources=[{{name: s, path: {path}}}]"], [name]
    return make


def _truncated_parquet(p):
    path = p.files / "truncated.parquet"
    data = (SAMPLE / "alpaca.parquet").read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return [f"curate.sources=[{{name: s, path: {path}}}]"], ["truncated.parquet"]


def _folder_source(p):
    folder = p.files / "a-folder"
    folder.mkdir(exist_ok=True)
    return [f"curate.sources=[{{name: s, path: {folder}}}]"], ["a-folder", "is a folder"]


def _target(edit):
    """A copy of the tiny target, changed by `edit(folder)`: its overrides name the copy."""
    def make(p):
        folder = p.files / f"target-{edit.__name__}"
        if not folder.exists():
            shutil.copytree(p.target, folder, ignore=shutil.ignore_patterns(".complete"))
            edit(folder)
        return [f"target.path={folder}"], [str(folder)]
    return make


def _truncate_weights(folder):
    w = folder / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])


def _garbage_weights(folder):
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)


def _bad_header_weights(folder):
    header = b"{not json at all"
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 32)


def _no_weights(folder):
    (folder / "model.safetensors").unlink()


def _missing_shard(folder):
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _no_config(folder):
    (folder / "config.json").unlink()


def _config_not_json(folder):
    (folder / "config.json").write_text("{ half a config")


def _config_without_model_type(folder):
    (folder / "config.json").write_text("{}")


def _corrupt_tokenizer(folder):
    (folder / "tokenizer.json").write_text("{ this is not a tokenizer")


def _template(text):
    def edit(folder):
        (folder / "chat_template.jinja").write_text(text)
    edit.__name__ = "template-" + hashlib.sha256(text.encode()).hexdigest()[:8]
    return edit


def _no_template(folder):
    (folder / "chat_template.jinja").unlink()
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tc))


def _empty_tokenizer_folder(p):
    folder = p.files / "empty-tokenizer"
    folder.mkdir(exist_ok=True)
    return ["curate.tokenizer=" + str(folder), "curate.max_prompt_tokens=100"], ["curate.tokenizer"]


def _config_file(text: str):
    def make(p):
        path = p.files / f"config-{hashlib.sha256(text.encode()).hexdigest()[:8]}.yaml"
        path.write_text(text)
        return path
    return make


def _root_is_a_file(p):
    f = p.files / "a-file"
    f.write_text("x")
    return [f"root={f}"], ["root", "is a file"]


def _root_under_a_file(p):
    f = p.files / "b-file"
    f.write_text("x")
    return [f"root={f}/run"], ["root", "is a file"]


# The thinking-off template of the tiny target, made to drop the prior reasoning: not prefix-stable.
UNSTABLE = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<|im_start|>assistant\n"
            "{{ m['content'] }}<|im_end|>\n{% elif m['role'] == 'assistant' %}<|im_start|>assistant\n<think>\n"
            "{{ (m.get('reasoning_content') or '') }}\n</think>\n\n{{ m['content'] }}<|im_end|>\n{% else %}"
            "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# ----------------------------------------------------------------------------- the catalogue

# id -> (overrides, or a builder of (overrides, expected texts); expected texts in the error line)
CONFIG = {
    "enable_thinking_above_1": (["regenerate.enable_thinking=2.0"], ["regenerate.enable_thinking", "0..1"]),
    "enable_thinking_negative": (["regenerate.enable_thinking=-0.5"], ["regenerate.enable_thinking"]),
    "eval_fraction_above_1": (["curate.eval_fraction=1.5"], ["curate.eval_fraction"]),
    "negative_lr": (["train.lr=-1"], ["train.lr"]),
    "lr_not_a_number": (["train.lr=fast"], ["train.lr"]),
    "unknown_key": (["train.lrr=1"], ["train.lrr"]),
    "unknown_drafter_kind": (["drafter.kind=medusa"], ["medusa"]),
    "zero_taps": (["drafter.num_taps=0"], ["drafter.num_taps"]),
    "tap_beyond_the_target": (["drafter.target_layer_ids=[1,2,40]"], ["40"]),
    "taps_vs_num_taps": (["drafter.target_layer_ids=[1,2]"], ["drafter"]),
    "bad_layer_type": (["drafter.layer_types=[full_attention,bogus]"], ["layer_types"]),
    "eagle3_no_layers": (["drafter.kind=eagle3", "drafter.num_layers=0"], ["num_layers"]),
    "unknown_policy": (["tokenize.policy=everything"], ["tokenize.policy"]),
    "unknown_extract_dtype": (["extract.dtype=int4"], ["extract.dtype"]),
    "top_p_zero": (["regenerate.top_p=0"], ["regenerate.top_p"]),
    "bad_target_device": (["target.device=gpu"], ["target.device"]),
    "bad_train_device": (["train.device=cuda:x"], ["train.device"]),
    "min_above_max_prompt_chars": (["curate.min_prompt_chars=100", "curate.max_prompt_chars=10"],
                                   ["curate.min_prompt_chars"]),
    "blocklist_not_a_regex": (["curate.blocklist=['(unclosed']"], ["curate.blocklist"]),
    "no_sources": (["curate.sources=[]"], ["curate.sources"]),
    "unknown_runner": (["runner.kind=slurm"], ["runner.kind"]),
    "override_without_value": (["train.lr"], ["train.lr"]),
    "override_below_a_value": (["train.lr.x=1"], ["train.lr.x"]),
    "empty_run_name": (["name="], ["name"]),
    "negative_lock_wait": (["lock.wait_s=-1"], ["lock.wait_s"]),
    "unknown_eval_category": ([f"curate.sources=[{{name: s, path: {SAMPLE}/sharegpt.jsonl, category: chat}}]",
                               "evaluate.categories=[chat, maths]"], ["evaluate.categories", "'maths'", "chat"]),
    "unknown_source_split": ([f"curate.sources=[{{name: s, path: {SAMPLE}/sharegpt.jsonl, split: test}}]"],
                             ["curate.sources.0.split"]),
    "unknown_baseline": (["evaluate.baselines=[ngram]"], ["evaluate.baselines"]),
}
SOURCES = {
    "missing_path": (["curate.sources=[{name: s, path: /no/such/file.jsonl}]"], ["/no/such/file.jsonl"]),
    "glob_matches_nothing": (["curate.sources=[{name: s, path: /no/such/dir/*.jsonl}]"], ["/no/such/dir/*.jsonl"]),
    "path_is_a_folder": (_folder_source, None),
    "parquet_of_some_bytes": (_file("bytes.parquet", b"these are not parquet bytes at all"), None),
    "truncated_parquet": (_truncated_parquet, None),
    "empty_parquet": (_file("empty.parquet", b""), None),
    "gz_not_gzip": (_file("plain.jsonl.gz", b'{"a": 1}\n'), None),
    "zst_not_zstd": (_file("plain.jsonl.zst", b'{"a": 1}\n'), None),
    "xz_truncated": (_file("cut.jsonl.xz", b"\xfd7zXZ\x00\x00"), None),
    "binary_jsonl": (_file("binary.jsonl", b"\x00\x01\x02PK\x03\x04" * 20), None),
    # A JSON array of objects is a format (ShareGPT V3's file is one); an array of anything else is not.
    "json_array_of_numbers": (_file("array.json", b"[1, 2, 3]"), None),
    "csv_named_jsonl": (_file("table.jsonl", b"question,answer\nwhy,because\n"), None),
    "count_and_weight": (["curate.sources=[{name: s, path: /x.jsonl, count: 3, weight: 1.0}]"], ["count"]),
    "neither_path_nor_hf": (["curate.sources=[{name: s}]"], ["path, hf, self_instruct or code_stubs"]),
    "duplicate_names": ([f"curate.sources=[{{name: s, path: {SAMPLE}/sharegpt.jsonl}}, "
                         f"{{name: s, path: {SAMPLE}/openai.jsonl}}]"], ["unique"]),
    "unknown_protocol": (["curate.sources=[{name: s, path: 'nosuch://bucket/x.jsonl'}]"], ["nosuch://bucket/x.jsonl"]),
    "unknown_format": ([f"curate.sources=[{{name: s, path: {SAMPLE}/sharegpt.jsonl, format: chatml}}]"], ["format"]),
}
TOKENIZERS = {
    "missing_curate_tokenizer": (["curate.tokenizer=/no/such/tokenizer", "curate.max_prompt_tokens=100"],
                                 ["curate.tokenizer", "/no/such/tokenizer"]),
    "empty_curate_tokenizer_folder": (_empty_tokenizer_folder, None),
    "corrupt_target_tokenizer": (_target(_corrupt_tokenizer), None),
}
TARGETS = {
    "missing_folder": (["target.path=/no/such/model"], ["target.path", "/no/such/model"]),
    "no_config_json": (_target(_no_config), None),
    "config_not_json": (_target(_config_not_json), None),
    "config_without_model_type": (_target(_config_without_model_type), None),
    "half_written_weights": (_target(_truncate_weights), None),
    "weights_of_garbage": (_target(_garbage_weights), None),
    "weights_header_not_json": (_target(_bad_header_weights), None),
    "no_weights": (_target(_no_weights), None),
    "index_names_a_missing_shard": (_target(_missing_shard), None),
}
TEMPLATES = {
    "no_template": (_target(_no_template), None),
    "template_raises": (_target(_template("{{ raise_exception('this template refuses everything') }}")), None),
    "template_syntax_error": (_target(_template("{% for m in messages %}{{ m['content'] }")), None),
    "template_ignores_messages": (_target(_template("hello")), None),
    "template_drops_the_answer": (_target(_template(
        "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}ASSISTANT:{% endif %}")), None),
    "all_turns_on_an_unstable_template": (_target(_template(UNSTABLE)), None, ["tokenize.policy=all_turns"]),
}
ROOTS = {
    "root_is_a_file": (_root_is_a_file, None),
    "root_under_a_file": (_root_under_a_file, None),
    "root_unknown_protocol": (["root=nosuch://bucket/run"], ["root", "nosuch://bucket/run"]),
}
CATALOGUE = {f"{group}-{name}": case for group, cases in
             (("config", CONFIG), ("source", SOURCES), ("tokenizer", TOKENIZERS), ("target", TARGETS),
              ("template", TEMPLATES), ("root", ROOTS)) for name, case in cases.items()}


@pytest.mark.parametrize("case", sorted(CATALOGUE))
def test_bad_input_is_one_line_and_leaves_the_root_alone(case, prepared, capsys):
    spec, expected, *extra = CATALOGUE[case]
    if callable(spec):
        overrides, built = spec(prepared)
        expected = expected or built
    else:
        overrides = spec
    code, err = _run_cli(capsys, prepared, TINY, [*overrides, *(extra[0] if extra else [])])
    _assert_one_line(code, err, expected, prepared)


CONFIG_FILES = {
    "missing": (lambda p: p.files / "no-such.yaml", ["config file not found", "no-such.yaml"]),
    "not_yaml": (_config_file("name: [unclosed\n"), ["not valid YAML"]),
    "a_list": (_config_file("- name: x\n"), ["mapping"]),
    "unknown_section": (_config_file("name: x\ntrainer: {lr: 1}\n"), ["trainer"]),
}


@pytest.mark.parametrize("case", sorted(CONFIG_FILES))
def test_a_bad_config_file_is_one_line(case, prepared, capsys):
    make, expected = CONFIG_FILES[case]
    code, err = _run_cli(capsys, prepared, str(make(prepared)), [])
    _assert_one_line(code, err, expected, prepared)


def test_a_read_only_root_is_one_line(prepared, capsys):
    import os

    if os.access("/proc/sys", os.W_OK):
        pytest.skip("/proc/sys is writable here")
    code, err = _run_cli(capsys, prepared, TINY, ["root=/proc/sys/draftflow-run"])
    _assert_one_line(code, err, ["root", "not writable"], prepared)


def test_a_root_without_space_is_one_line(prepared, capsys, monkeypatch):
    import draftflow.runs.plan

    monkeypatch.setattr(draftflow.runs.plan, "free_space", lambda root: 1 << 20)
    code, err = _run_cli(capsys, prepared, TINY, ["extract.force=true"])
    _assert_one_line(code, err, ["root", "1.0 MiB free"], prepared)


# Storage failing mid-run: the pipeline raises what storage raises; the hint must match the cause.
def _storage_errors():
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    return {
        "disk_full_with_force": (OSError(errno.ENOSPC, "No space left on device", "/r/extract/ab/shard.st"),
                                 ["/r/extract/ab/shard.st", "full"], "credentials"),
        "permission_denied": (PermissionError(errno.EACCES, "Permission denied", "/r/curate"),
                              ["/r/curate", "permission"], "credentials"),
        "read_only_fs": (OSError(errno.EROFS, "Read-only file system", "/r/x"), ["/r/x", "permission"], "space"),
        "not_found": (FileNotFoundError(errno.ENOENT, "No such file or directory", "/r/gone"),
                      ["/r/gone", "does not exist"], "credentials"),
        "no_credentials": (NoCredentialsError(), ["credentials", "AWS_ACCESS_KEY_ID"], "space"),
        "bad_endpoint": (EndpointConnectionError(endpoint_url="http://localhost:1"), ["AWS_ENDPOINT_URL"],
                         "credentials"),
        "access_denied": (ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}, "PutObject"),
                          ["permission"], "space"),
        "s3fs_bad_key": (PermissionError("The AWS Access Key Id you provided does not exist in our records."
                                         " (InvalidAccessKeyId)"), ["credentials"], "space"),
    }


@pytest.mark.parametrize("case", ["disk_full_with_force", "permission_denied", "read_only_fs", "not_found",
                                  "no_credentials", "bad_endpoint", "access_denied", "s3fs_bad_key"])
def test_storage_errors_get_the_hint_of_their_cause(case, prepared, capsys, monkeypatch):
    exc, expected, unexpected = _storage_errors()[case]

    def pipeline(cfg):
        raise exc

    # A stand-in for flows.pipeline: the run gets past preflight and the lock, then storage refuses.
    monkeypatch.setitem(sys.modules, "flows.pipeline", types.SimpleNamespace(pipeline=pipeline))
    code, err = _run_cli(capsys, prepared, TINY, ["extract.force=true"])
    line = _assert_one_line(code, err, expected, prepared)
    assert unexpected not in line.split(";", 1)[1]


def test_user_storage_errors_are_not_retried():
    from botocore.exceptions import NoCredentialsError

    from draftflow.store import USER_CAUSES, storage_cause

    assert storage_cause(OSError(errno.ENOSPC, "full")) in USER_CAUSES
    assert storage_cause(PermissionError(errno.EACCES, "denied")) in USER_CAUSES
    assert storage_cause(NoCredentialsError()) in USER_CAUSES
    assert storage_cause(ConnectionResetError(errno.ECONNRESET, "reset")) not in USER_CAUSES  # retried


def test_a_file_that_goes_bad_after_preflight_is_named_when_read(tmp_path):
    from draftflow.data.readers import read_file
    from draftflow.errors import SourceError

    bad = tmp_path / "late.parquet"
    bad.write_bytes(b"PAR1 not really parquet PAR1")
    with pytest.raises(SourceError, match="late.parquet"):
        list(read_file(str(bad)))
    gz = tmp_path / "late.jsonl.gz"
    gz.write_bytes(b"\x1f\x8b\x08\x00" + b"\x00" * 6)  # a gzip header, then nothing: truncated
    with pytest.raises(SourceError, match="late.jsonl.gz"):
        list(read_file(str(gz)))


def test_catalogue_size():
    assert len(CATALOGUE) + len(CONFIG_FILES) + 2 + len(_storage_errors()) >= 40
