"""The served-speedup arithmetic without vLLM: counter windows, per-prompt τ, ratios, lossless flags, report.

vLLM itself is exercised in tests/vllm/test_real_target.py; here a stand-in `LLM` advances known counters, so
the exact τ, P(at least k accepted) and per-category figures are checked (the warm-up request and the repeats
at other batch sizes must not leak into them).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from draftflow.engines.vllm_serve import ServedResult, ServeJob, decode_timed
from draftflow.evaluation import serve_choice, served

VLLM = SimpleNamespace(SamplingParams=lambda **kw: kw)


class CountingLLM:
    """Each request yields `max_tokens` tokens; with `drafting`, each request adds 4 drafting steps that
    accepted 6 tokens in all (3 at position 1, 2 at 2, 1 at 3), except prompt 0, which adds 2 steps, 0 accepted."""

    def __init__(self, drafting: bool = True):
        self.drafting, self.drafts, self.accepted, self.per_pos = drafting, 0, 0, [0, 0, 0]

    def generate(self, prompts, params, use_tqdm=False):
        outs = []
        for p in prompts:
            first = p["prompt_token_ids"][0] == 0
            if self.drafting:
                self.drafts += 2 if first else 4
                self.accepted += 0 if first else 6
                self.per_pos = [a + b for a, b in zip(self.per_pos, [0, 0, 0] if first else [3, 2, 1])]
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(params["max_tokens"])))]))
        return outs

    def get_metrics(self):
        return [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=self.drafts),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=self.accepted),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=self.per_pos)]


def test_decode_timed_counts_only_the_first_batch_size_and_each_prompt_at_batch_one():
    prompts = [[0, 5], [1, 5], [2, 5]]
    run = decode_timed(CountingLLM(), VLLM, prompts, 10, [2], (1, 8))
    assert run["per_prompt"] == [(2, 0), (4, 6), (4, 6)]  # the warm-up (prompt 0 again) is not in prompt 0's count
    assert run["counters"] == (10, 12, [6, 4, 2])  # batch 1 only: not the warm-up, not the batch-8 repeat
    assert set(run["tok_s"]) == {1, 8} and all(v > 0 for v in run["tok_s"].values())
    assert run["tokens_by_batch"][1] == run["tokens_by_batch"][8] == [list(range(10))] * 3
    untimed = decode_timed(CountingLLM(), VLLM, prompts, 10, [2], (3,), warm_up=False)
    assert untimed["per_prompt"] == [] and untimed["counters"] == (10, 12, [6, 4, 2])


def _result(tok_s: dict[int, float], tokens: dict[int, list], per_prompt=(), tau=None) -> ServedResult:
    first = next(iter(tokens))
    return ServedResult("x", tokens[first], tau, [0.5], 4, 2, list(per_prompt), tok_s, tokens)


def test_measure_reports_ratios_lossless_flags_and_tau_per_category(monkeypatch):
    same, other = [[1, 2], [3]], [[1, 2], [4]]
    runs = {None: _result({1: 20.0, 8: 80.0}, {1: same, 8: same}),
            "dflash": _result({1: 30.0, 8: 60.0}, {1: same, 8: other}, [(4, 6), (2, 0)], tau=2.0),
            "ngram": _result({1: 21.0, 8: 84.0}, {1: same, 8: same}, [(0, 0), (1, 1)], tau=2.0)}
    monkeypatch.setattr(served, "serve_with_vllm", lambda job, export=None, spec=None: runs[(spec or {}).get("method")
                                                                                   or (export and "dflash")])
    job = ServeJob("t", [[0], [1]], 8, [2], None, "float32", (1, 8), ("chat", "code"))
    record, results = served.measure(job, {"dflash": ("export", None), "prompt_lookup": (None, {"method": "ngram"})},
                                     greedy=[[1, 2], [9]])
    d = record["methods"]["dflash"]
    assert d["speedup"] == {"1": 1.5, "8": 0.75} and d["lossless"] == {"1": True, "8": False}
    assert d["tau_per_category"] == {"chat": 2.5, "code": 1.0}
    assert record["methods"]["prompt_lookup"]["tau_per_category"] == {"chat": None, "code": 2.0}  # no step: no τ
    assert record["plain"]["equal_to_draftflow_greedy"] == "1/2" and results["dflash"] is runs["dflash"]
    text = "\n".join(served.render(record, {"dflash": 2.1, "prompt_lookup": 1.4}))
    assert "| dflash | 2.000 | 2.100 | 30.0 | 1.50 | yes | 60.0 | 0.75 | NO |" in text
    for table in text.split("\n\n"):  # one column count per markdown table
        rows = [line for line in table.splitlines() if line.startswith("|")]
        assert len({line.count("|") for line in rows}) <= 1, table


def test_a_plain_run_that_produced_nothing_gives_no_ratio_rather_than_a_traceback(monkeypatch):
    job = ServeJob("t", [[0]], 8, [2], None, "float32", (1,), ("chat",))
    runs = iter([_result({1: 0.0}, {1: [[]]}), _result({1: 5.0}, {1: [[]]}, [(1, 1)], tau=2.0)])
    monkeypatch.setattr(served, "serve_with_vllm", lambda *a, **k: next(runs))
    record, _ = served.measure(job, {"dflash": ("e", None)}, greedy=[[]])
    assert record["methods"]["dflash"]["speedup"] == {"1": None}
    assert "n/a" in "\n".join(served.render(record, {}))


def test_per_category_without_drafting_steps_is_none():
    assert served.per_category(["a", "a"], [(0, 0), (0, 0)]) == {"a": None}
    assert served.per_category(["a", "b"], [(2, 2), (1, 0)]) == {"a": pytest.approx(2.0), "b": 1.0}


TOKS = {1: [[1, 2]], 8: [[1, 2]]}
# plain: a step of 0.1 s at batch 1 (10 tok/s), verifying probed at +0.01 s a position (x batch)
PLAIN = ServedResult("plain", [[1, 2]], None, [], 0, 0, [], {1: 10.0, 8: 60.0}, TOKS,
                     {b: {n: 0.5 + 0.01 * (n - 1) * b for n in range(1, 5)} for b in (1, 8)})
DRAFTER = ServedResult("d", [[1, 2]], 1.7, [0.6, 0.08, 0.02], 10, 7, [], {1: 8.0, 8: 30.0}, TOKS)  # K=3


def choose_with(monkeypatch, tmp_path, chosen: ServedResult, drafter: ServedResult = DRAFTER) -> tuple[dict, list]:
    """`served.measure` on stand-in engines: plain (`PLAIN`), the drafter with its 3 drafts (`DRAFTER`), and
    `chosen` for any other setting (`drafter` for its 3 drafts); returns the record and the speculative configs
    served."""
    export = tmp_path / "export"
    export.mkdir()
    monkeypatch.setattr("draftflow.engines.vllm_serve.speculative_config",
                        lambda e: {"method": "dflash", "model": str(e), "num_speculative_tokens": 3})
    served_with = []

    def fake_serve(job, export_dir=None, spec=None):
        if export_dir is None and spec is None:
            return PLAIN
        served_with.append(spec)
        return drafter if spec is None else chosen

    monkeypatch.setattr(served, "serve_with_vllm", fake_serve)
    job = ServeJob("t", [[0]], 8, [2], None, "float32", (1, 8), ("chat",), probe_positions=4)
    record, _ = served.measure(job, {"dflash": (export, None)}, greedy=[[1, 2]])
    return record, served_with


def test_the_setting_predicted_fastest_is_served_and_measured(monkeypatch, tmp_path):
    """Fixed figures (`PLAIN`, `DRAFTER`: tau 1.7 at 8 tok/s, acceptance 0.6/0.08/0.02): the drafter with one
    draft is predicted fastest at batch 1 and served with num_speculative_tokens 1; at batch 8 plain wins."""
    record, served_with = choose_with(monkeypatch, tmp_path, ServedResult("k1", [[1, 2]], 1.4, [0.4], 5, 2, [],
                                                                         {1: 12.5, 8: 40.0}, TOKS))
    choice = record["choice"]
    # batch 1: drafting pass = 1 * 1.7 / 8 - (0.1 + 0.03) = 0.0825 s at K=3, (k+1)/(K+1) of it at k
    k1 = 1.6 * 0.1 / (0.1 + 0.01 + 0.0825 / 2)
    assert choice["1"]["setting"] == "dflash:k=1" and choice["1"]["predicted"] == pytest.approx(k1, rel=1e-3)
    assert choice["1"]["measured"] == pytest.approx(12.5 / 10.0) and choice["1"]["lossless"] is True
    assert choice["8"]["setting"] == "plain" and choice["8"]["measured"] == 1.0
    assert served_with == [None, {"method": "dflash", "model": str(tmp_path / "export"), "num_speculative_tokens": 1}]
    text = "\n".join(served.render(record, {"dflash": 1.5}))
    assert "| 1 | dflash:k=1 | x1.06 | x1.25 | yes |" in text and "| 8 | plain | x1.00 | x1.00 | yes |" in text


def test_a_chosen_setting_measured_slower_than_plain_is_overruled(monkeypatch, tmp_path):
    """The chosen dflash:k=1 serves at 7 tok/s against plain's 10: the recommendation at batch 1 becomes
    plain decoding, and the report says what was predicted and measured."""
    record, _ = choose_with(monkeypatch, tmp_path, ServedResult("k1", [[1, 2]], 1.4, [0.4], 5, 2, [],
                                                                {1: 7.0, 8: 40.0}, TOKS))
    b1 = record["choice"]["1"]
    assert (b1["setting"], b1["predicted"], b1["measured"]) == ("plain", 1.0, 1.0)
    assert b1["overruled"]["setting"] == "dflash:k=1" and b1["overruled"]["measured"] == pytest.approx(0.7)
    assert "dflash:k=1 was predicted x1.06 and measured x0.70, so the recommendation is plain decoding" in \
        "\n".join(served.render(record, {}))


def test_an_overruled_setting_falls_back_to_the_fastest_measured_one_that_beat_plain():
    """2026-12-05 on SmolLM2: the chosen dflash:k=1 measured x0.91 while the drafter served with both drafts had
    measured x1.09; the fallback takes the fastest lossless setting measured at least as fast as plain, else plain."""
    k1 = ServedResult("k1", [[1, 2]], 1.3, [0.3], 5, 2, [], {1: 9.1, 8: 40.0}, TOKS)
    k2 = ServedResult("k2", [[1, 2]], 1.3, [0.3, 0.06], 5, 2, [], {1: 10.9, 8: 40.0}, TOKS)
    lossy = ServedResult("k3", [[1, 2]], 1.3, [0.3], 5, 2, [], {1: 12.0, 8: 40.0}, {1: [[1, 3]], 8: [[1, 3]]})
    assert served.best_measured(1, PLAIN, {"dflash:k=1": k1, "dflash:k=2": k2, "dflash:k=3": lossy}) == \
        ("dflash:k=2", k2)
    assert served.best_measured(8, PLAIN, {"dflash:k=1": k1, "dflash:k=2": k2}) == ("plain", None)
    choice = {"1": {"setting": "dflash:k=2", "predicted": 1.09, "measured": 1.09, "lossless": True,
                    "best_speculative": "dflash:k=1", "best_predicted": 1.11, "table": {},
                    "overruled": {"setting": "dflash:k=1", "predicted": 1.11, "measured": 0.91}}}
    assert ("dflash:k=1 was predicted x1.11 and measured x0.91, so the recommendation is dflash:k=2, measured faster "
            "than plain here") in "\n".join(served.render_choice(choice))


def test_served_falls_back_to_the_drafter_with_its_own_drafts_when_that_measured_faster(monkeypatch, tmp_path):
    """The drafter served with its 3 drafts measured 10.5 tok/s against plain's 10; the chosen k = 1 measured 7:
    the recommendation at batch 1 is dflash:k=3 (x1.05), with the overruled choice kept in the report."""
    fast = ServedResult("d", [[1, 2]], 1.7, [0.6, 0.08, 0.02], 10, 7, [], {1: 10.5, 8: 30.0}, TOKS)
    record, _ = choose_with(monkeypatch, tmp_path, ServedResult("k1", [[1, 2]], 1.4, [0.4], 5, 2, [],
                                                                {1: 7.0, 8: 40.0}, TOKS), drafter=fast)
    b1 = record["choice"]["1"]
    assert (b1["setting"], b1["measured"]) == ("dflash:k=3", pytest.approx(1.05))
    assert b1["overruled"]["setting"] == "dflash:k=1" and b1["overruled"]["measured"] == pytest.approx(0.7)
    assert record["choice"]["8"]["setting"] == "plain"


def test_an_overruled_choice_serves_the_runner_up_prediction_before_falling_back(monkeypatch, tmp_path):
    """2026-12-06 on SmolLM2: one draft measured slower than plain for both kinds although predicted faster. Here
    the drafter (tau 1.92 at 12 tok/s with its 3 drafts, acceptance 0.6/0.3/0.02) is predicted fastest at k = 2
    (x1.333), which serves at 7 tok/s (x0.70): the runner-up k = 1 (x1.28, not yet measured; k = 3 was, as the
    method) is served too, at 13 tok/s, and recommended with its own prediction."""
    export = tmp_path / "export"
    export.mkdir()
    monkeypatch.setattr("draftflow.engines.vllm_serve.speculative_config",
                        lambda e: {"method": "dflash", "model": str(e), "num_speculative_tokens": 3})
    drafter = ServedResult("d", [[1, 2]], 1.92, [0.6, 0.3, 0.02], 10, 9, [], {1: 12.0, 8: 30.0}, TOKS)
    by_k = {2: 7.0, 1: 13.0}
    served_with = []

    def fake_serve(job, export_dir=None, spec=None):
        if export_dir is None and spec is None:
            return PLAIN
        served_with.append(None if spec is None else spec["num_speculative_tokens"])
        if spec is None:
            return drafter
        return ServedResult("k", [[1, 2]], 1.5, [0.5], 5, 2, [], {1: by_k[spec["num_speculative_tokens"]], 8: 20.0},
                            TOKS)

    monkeypatch.setattr(served, "serve_with_vllm", fake_serve)
    job = ServeJob("t", [[0]], 8, [2], None, "float32", (1, 8), ("chat",), probe_positions=4)
    record, _ = served.measure(job, {"dflash": (export, None)}, greedy=[[1, 2]])
    b1 = record["choice"]["1"]
    assert served_with == [None, 2, 1]  # the method, the first choice, the runner-up; nothing at batch 8
    assert b1["overruled"] == {"setting": "dflash:k=2", "predicted": pytest.approx(1.3333, abs=1e-4),
                               "measured": pytest.approx(0.7)}
    assert (b1["setting"], b1["predicted"], b1["measured"]) == ("dflash:k=1", pytest.approx(1.28, abs=1e-4),
                                                               pytest.approx(1.3))
    assert record["choice"]["8"]["setting"] == "plain"
    assert served.runner_up(serve_choice.choose([], serve_choice.Costs(0.1, {1: 0.1})), set()) is None
