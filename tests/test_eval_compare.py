"""Categories, baselines and the predicted speedup of the evaluate stage (issue 15, points 2-4).

Real pieces throughout: curation of real source files, the code-built tiny Qwen3 target, a real
(untrained) DFlash drafter and the reference decoding loop.
"""

from __future__ import annotations

import json

import pytest
import torch

from draftflow.config import CurateConfig, EvaluateConfig, SourceConfig, load_config
from draftflow.contracts import StageResult
from draftflow.data.schema import read_rows
from draftflow.drafters.dflash.model import DFlashDrafter
from draftflow.errors import ConfigError
from draftflow.evaluation import speedup
from draftflow.evaluation.baselines import NoDraft, PromptLookup, lookup, make_baselines
from draftflow.evaluation.decode import evaluate_prompts, greedy_generate, speculative_generate
from draftflow.evaluation.selection import check_categories, prompt_set, row_category, select
from draftflow.evaluation.suite import add_comparisons, run_baselines, split_stats, with_counts
from draftflow.evaluation.summary import console_lines, draw_plots, headline, markdown
from draftflow.stages import curate
from draftflow.store import Store
from tests.conftest import B, stamped

# ----------------------------------------------------------------------------- curation keeps categories


def _sources(tmp_path):
    chat = tmp_path / "chat.jsonl"
    chat.write_text(
        "".join(
            json.dumps(
                {"messages": [{"role": "user", "content": f"Hello number {i}"}, {"role": "assistant", "content": "Hi"}]}
            )
            + "\n"
            for i in range(20)
        )
    )
    mixed = tmp_path / "mixed.jsonl"
    rows = [{"prompt": f"Compute {i} plus {i}", "kind": "math"} for i in range(5)]
    rows += [{"prompt": f"Write function number {i}", "kind": "code"} for i in range(5)]
    rows += [{"prompt": "No kind given here"}]
    mixed.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [
        SourceConfig(name="chat", path=str(chat), category="chat"),
        SourceConfig(name="plain", path=str(chat).replace("chat.jsonl", "plain.jsonl")),
    ], SourceConfig(
        name="mixed", path=str(mixed), format="prompt", category_field="kind", category="other", split="eval"
    )


def _curate(root, sources, eval_fraction=0.2):
    cfg = load_config(None, [f"root={root}"])
    cfg.curate.sources, cfg.curate.eval_fraction, cfg.curate.shard_rows = sources, eval_fraction, 8
    m = curate.run(Store(str(root)), stamped("curate", "fp", {}), cfg)
    rows = {
        s: [r for sh in m.shards if sh.split == s for r in read_rows(f"{root}/curate/fp/{sh.name}")]
        for s in ("train", "eval")
    }
    return m, rows


def test_categories_survive_curation_and_an_eval_only_source_leaves_training_unchanged(tmp_path):
    (chat, plain), mixed = _sources(tmp_path)
    (tmp_path / "plain.jsonl").write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"Plain question {i}"}]}) + "\n" for i in range(10)
        )
    )
    _, before = _curate(tmp_path / "a", [chat, plain])
    m, after = _curate(tmp_path / "b", [chat, plain, mixed])
    # Training data and its order are those of the run without the eval-only source; ids are stable.
    assert [r["sample_id"] for r in after["train"]] == [r["sample_id"] for r in before["train"]]
    assert not any(r["source"] == "mixed" for r in after["train"])
    evals = after["eval"]
    assert sum(r["source"] == "mixed" for r in evals) == 11  # every row of the eval-only source
    by_source = {(r["source"], r["category"]) for r in evals}
    assert {("mixed", "math"), ("mixed", "code"), ("mixed", "other")} <= by_source  # field, else `category`
    assert {r["category"] for r in evals if r["source"] == "chat"} <= {"chat"}
    assert all(r["category"] is None for r in evals if r["source"] == "plain")
    assert {row_category(r) for r in evals if r["source"] == "plain"} <= {"plain"}  # the source's name
    # A category changes curate's rows, never a sample id.
    _, again = _curate(tmp_path / "c", [chat.model_copy(update={"category": "talk"}), plain, mixed])
    assert [r["sample_id"] for r in again["train"]] == [r["sample_id"] for r in after["train"]]
    assert {r["category"] for r in again["eval"] if r["source"] == "chat"} <= {"talk"}


def test_a_category_column_holding_a_list_is_a_counted_reject(tmp_path):
    src = tmp_path / "bad.jsonl"
    bad = [{"prompt": "ok", "kind": ["a"]}, {"prompt": "fine", "kind": 3}]
    src.write_text("".join(json.dumps(r) + "\n" for r in bad))
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"prompt": f"train {i}"}) + "\n" for i in range(4)))
    m, rows = _curate(
        tmp_path / "r",
        [
            SourceConfig(name="t", path=str(tmp_path / "t.jsonl")),
            SourceConfig(name="bad", path=str(src), category_field="kind", split="eval"),
        ],
    )
    assert m.dropped.get("bad_category") == 1
    assert [r["category"] for r in rows["eval"] if r["source"] == "bad"] == ["3"]


# ----------------------------------------------------------------------------- selection and per-category sums


def test_select_interleaves_categories_and_an_unknown_category_is_one_line():
    cats = ["code", "chat", "chat", "math", "code", "chat"]
    assert select(cats, None, None) == [1, 0, 3, 2, 4, 5]  # chat, code, math by name, then round two
    assert select(cats, ["math", "chat"], 3) == [3, 1, 2]
    assert select(["a"] * 4, None, 2) == [0, 1]  # one category: the eval order unchanged
    with pytest.raises(ConfigError) as err:
        select(cats, ["chat", "maths"], None)
    text = str(err.value)
    assert "\n" not in text and "'maths'" in text and "chat, code, math" in text


def test_preflight_rules_out_a_category_that_no_source_gives():
    sources = [
        SourceConfig(name="a", path="x", category="chat"),
        SourceConfig(name="b", path="y"),
        SourceConfig(name="t", path="z", category="math", split="train"),
    ]  # train-only: no eval prompt
    check_categories(CurateConfig(sources=sources), EvaluateConfig(categories=["chat", "b"]))
    with pytest.raises(
        ConfigError, match=r"'math', which no curate source with eval prompts gives \(categories: b, chat\)"
    ):
        check_categories(CurateConfig(sources=sources), EvaluateConfig(categories=["math"]))
    sources.append(SourceConfig(name="c", path="w", category_field="kind"))  # could give any name: the stage checks
    check_categories(CurateConfig(sources=sources), EvaluateConfig(categories=["math"]))


def test_per_category_stats_add_up_to_the_whole():
    lengths = [[1, 3, 2], [4], [1, 1], [2, 2, 2, 1]]
    outputs = [[0] * 7, [0] * 5, [0] * 3, [0] * 8]
    cats = ["x", "y", "x", "z"]
    parts = split_stats(lengths, outputs, cats, 5)
    whole = split_stats(lengths, outputs, ["all"] * 4, 5)["all"]
    for key in ("steps", "tokens", "prompts"):
        assert sum(p[key] for p in parts.values()) == whole[key]
    assert [sum(h) for h in zip(*(p["accept_histogram"] for p in parts.values()))] == whole["accept_histogram"]
    assert parts["x"]["tau"] == pytest.approx(8 / 5)


# ----------------------------------------------------------------------------- baselines


def test_prompt_lookup_copies_the_latest_match_of_the_longest_suffix():
    assert lookup([5, 1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 3) == [7, 1, 2]  # latest "1 2 3", not the first
    assert lookup([1, 2, 8, 2], 4) == [8, 2]  # n=1 when no longer suffix matches; cut at the end
    assert lookup([1, 2, 3], 4) == []
    assert lookup([4, 4, 4, 4], 2) == [4]
    assert PromptLookup(name="p", max_drafts=2).propose([1, 2, 3, 1], 2) == [3, 1]
    assert NoDraft(name="n", max_drafts=7).propose([1, 1, 1], 1) == []
    with pytest.raises(ConfigError, match="unknown baseline 'ngram'"):
        make_baselines(["ngram"], 3)


@pytest.fixture(scope="module")
def drafter(target, dcfg):
    torch.manual_seed(1)
    return DFlashDrafter(dcfg, target).eval()


@pytest.fixture(scope="module")
def measured(target, drafter):
    """A repetitive prompt (its greedy continuation appended twice) and two random ones, decoded with
    the drafter and then compared: categories, baselines and speedup."""
    g = torch.Generator().manual_seed(3)
    randoms = torch.randint(0, 300, (2, 6), generator=g).tolist()
    seed = randoms[0][:4]
    loop = greedy_generate(target, seed, 12, set())
    prompts = [seed + loop + seed + loop + seed] + randoms
    cats = ["rep", "rand", "rand"]
    ecfg = EvaluateConfig(max_new_tokens=12)
    stats = evaluate_prompts(target, drafter, prompts, ecfg, set())
    add_comparisons(target, drafter, stats, prompts, cats, ecfg, set())
    return stats, prompts


def test_baselines_decode_the_same_prompts_losslessly(measured, target):
    stats, prompts = measured
    outputs = stats["outputs"]
    assert [greedy_generate(target, p, 12, set()) for p in prompts] == outputs  # compare checked each baseline
    no_draft, lookup_ = stats["baselines"]["no_draft"], stats["baselines"]["prompt_lookup"]
    for b in (no_draft, lookup_):
        assert b["prompts"] == stats["prompts"] == len(prompts) and b["tokens"] == stats["tokens"]
        assert set(b["categories"]) == set(stats["categories"]) == {"rep", "rand"}
    assert no_draft["tau"] == 1.0 and no_draft["steps"] == stats["tokens"] - len(prompts)
    for run in (stats, no_draft, lookup_):  # the categories of a real run add up to it
        for key in ("steps", "tokens", "prompts"):
            assert sum(c[key] for c in run["categories"].values()) == run[key], key
    assert lookup_["categories"]["rep"]["tau"] > 1.0  # the repetitive prompt's continuation is copied
    assert len(lookup_["accept_histogram"]) == len(stats["accept_histogram"])  # same block size


def test_baselines_in_the_cached_loop_equal_the_reference_loop(measured, target):
    stats, prompts = measured  # its baselines ran KV-cached (evaluate.kv_cache defaults to true)
    bases = make_baselines(["no_draft", "prompt_lookup"], B - 1)
    ref = run_baselines(
        target, bases, prompts, stats["outputs"], 12, set(), ["rep", "rand", "rand"], speculative_generate
    )
    assert ref == stats["baselines"]


def test_no_draft_taken_from_the_reference_is_what_its_decoding_would_give(measured, target):
    stats, prompts = measured  # run_baselines no longer decodes no_draft: its figures follow from greedy
    no_draft = NoDraft(name="no_draft", max_drafts=B - 1)
    for eos in (set(), {stats["outputs"][0][4]}):  # run to max_new_tokens, and stopped by an end token
        decoded = [speculative_generate(target, no_draft, p, 12, eos) for p in prompts]
        outputs, lengths = [t for t, _ in decoded], [a for _, a in decoded]
        cats = ["rep", "rand", "rand"]
        derived = run_baselines(target, [no_draft], prompts, outputs, 12, eos, cats)["no_draft"]
        assert derived == with_counts(lengths, outputs, B) | {"categories": split_stats(lengths, outputs, cats, B)}
    assert len(outputs[0]) == 5  # the end token did stop the first prompt


def test_speedup_fields_exist_are_positive_and_follow_the_serve_choice_model(measured):
    stats, _ = measured
    s = stats["speedup"]
    assert s["target_step_s"] > 0 and s["proposer_step_s"]["drafter"] > 0
    K = len(stats["acceptance_rate"])
    assert sorted(s["verify_s"]) == list(range(1, K + 1)) and all(t > 0 for t in s["verify_s"].values())
    assert s["model"] == speedup.MODEL and s["device"].startswith("cpu")
    if s["withheld"]:  # this machine's timer put verify well below a decode step: no figure rather than a wrong one
        assert s["verify_s"][K] < speedup.NOISE * s["target_step_s"] and s["predicted"] is None
        return
    k = int(s["drafter_setting"].rsplit("=", 1)[1])  # "dflash:k=<k>": the drafter's best k, recomputed here
    draft = s["proposer_step_s"]["drafter"] * (k + 1) / (K + 1)  # DFlash: one pass of k + 1 queries
    tau_k = 1 + sum(stats["acceptance_rate"][:k])
    assert s["predicted"] == pytest.approx(
        tau_k * s["target_step_s"] / (max(s["verify_s"][k], s["target_step_s"]) + draft), rel=1e-3)
    assert s["predicted"] == max(row["predicted"] for name, row in s["table"].items() if name.startswith("dflash"))
    assert "no_draft" not in s["predicted_per_proposer"]  # it drafts nothing: nothing to predict


def _costs(verify_last: float) -> dict:
    return {"target_step_s": 9.6e-3, "verify_s": {1: 9.7e-3, 2: 9.8e-3, 3: verify_last},
            "proposer_step_s": {"drafter": 1e-3}, "positions_verified": 4}


def test_a_verify_step_timed_below_a_decode_step_withholds_the_prediction():
    """Issue 22: a demo timed verifying 8 tokens at 6.4 ms against 9.6 ms for one and projected x2.41, above τ."""
    drafter = [speedup.Candidate("drafter", "dflash", [0.5, 0.3, 0.1], "block")]
    got = speedup.speedups(_costs(6.4e-3), drafter)
    assert got["predicted"] is None and set(got["predicted_per_proposer"].values()) == {None} and not got["table"]
    assert "measured cheaper than one decode step" in got["withheld"]
    near = speedup.speedups(_costs(9.0e-3), drafter)
    assert near["withheld"] is None  # within the timer's noise: verify counted as one decode step
    assert near["predicted"] == pytest.approx(max(
        (1 + sum([0.5, 0.3, 0.1][:k])) * 9.6 / (max(v, 9.6) + 1.0 * (k + 1) / 4)
        for k, v in {1: 9.7, 2: 9.8, 3: 9.0}.items()), rel=1e-3)  # the table keeps 4 digits
    line = console_lines(headline({"speedup": got, "baselines": {}}))[0]
    assert line.startswith("predicted speedup withheld: verify step (6.40 ms for 4 positions)")


def test_the_prediction_picks_fewer_drafts_when_later_ones_are_rarely_accepted():
    """Acceptance falling steeply by position (SmolLM2's DFlash: 26%, 4%, 0.6%) with each position costing 10% of
    a step and a drafting pass 0.8 of one (0.2 for one draft's 2 queries): one draft is the best setting, yet slower
    than plain decoding, so the choice is plain, with the best figure kept."""
    costs = {"target_step_s": 1.0, "verify_s": {k: 1.0 + 0.1 * k for k in range(1, 8)},
             "proposer_step_s": {"drafter": 0.8}, "positions_verified": 8}
    steep = speedup.speedups(costs, [speedup.Candidate("drafter", "dflash", [0.26, 0.04, 0.006] + [0.0] * 4,
                                                                  "block")])
    assert steep["drafter_setting"] == "dflash:k=1"
    assert steep["predicted"] == pytest.approx(1.26 / (1.1 + 0.2), rel=1e-3)
    assert steep["choice"]["setting"] == "plain" and steep["choice"]["best_speculative"] == "dflash:k=1"
    strong = speedup.speedups(costs, [speedup.Candidate("drafter", "dflash", [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3],
                                                        "block")])
    assert strong["choice"]["setting"] == strong["drafter_setting"] and strong["predicted"] > 2


def test_report_sections_plots_and_console_lines(measured, tmp_path):
    stats, _ = dict(measured[0]), None
    # the measured wall times vary with load (a busy machine may withhold the prediction): pin them so the
    # console line is the one a sane measurement prints; the withheld line is tested on its own above
    K = len(stats["acceptance_rate"])
    costs = stats["speedup"] | {"target_step_s": 1e-2, "verify_s": {k: 1e-2 + 1e-3 * k for k in range(1, K + 1)}}
    lookup = stats["baselines"]["prompt_lookup"]["acceptance_rate"]
    candidates = [speedup.Candidate("drafter", "dflash", stats["acceptance_rate"], "block"),
                  speedup.Candidate("prompt_lookup", "prompt_lookup", lookup, "free")]
    stats["speedup"] = speedup.speedups(costs, candidates)
    stats["plots"] = draw_plots(stats, tmp_path)
    assert all((tmp_path / p).read_bytes().startswith(b"\x89PNG") for p in stats["plots"])
    text = markdown(stats, "DFlash")
    assert "| rep |" in text and "| prompt_lookup |" in text and speedup.MODEL in text and "| dflash:k=1 |" in text
    for table in text.split("\n\n"):  # every markdown table: one column count for header, rule and rows
        rows = [line for line in table.splitlines() if line.startswith("|")]
        assert len({line.count("|") for line in rows}) <= 1, table
    lines = console_lines(headline(stats))
    assert lines[0].startswith("tau per category: rand ") and "no_draft tau 1.000" in lines[1]
    assert lines[2].startswith("predicted speedup x") and " at dflash:k=" in lines[2]


def test_the_stage_reads_the_selected_prompts_with_their_categories_and_ids(tmp_path, tiny_target):
    from draftflow.chat import ChatFormat
    from draftflow.stages.evaluate import eval_set
    from draftflow.target import load_target

    (chat, plain), mixed = _sources(tmp_path)
    (tmp_path / "plain.jsonl").write_text(
        "".join(json.dumps({"prompt": f"Plain question {i}"}) + "\n" for i in range(10))
    )
    m, rows = _curate(tmp_path / "r", [chat, plain, mixed])
    _, tokenizer = load_target(tiny_target.path, "float32", "cpu")
    curated = StageResult(stage="curate", fingerprint="fp", status="ran", digest="d", path="p", manifest=m)
    ecfg = EvaluateConfig(categories=["math", "code"], num_prompts=5)
    prompts, cats, n_eval, ids = eval_set(Store(str(tmp_path / "r")), curated, ChatFormat(tokenizer), False, ecfg)
    assert cats == ["math", "code", "math", "code", "math"] and n_eval == len(rows["eval"])
    by_id = {r["sample_id"]: r for r in rows["eval"]}
    assert [by_id[i]["category"] for i in ids] == cats and len(prompts) == 5
    assert prompt_set(ids) == prompt_set(list(ids)) != prompt_set(ids[::-1])
    with pytest.raises(ConfigError, match="'poetry', which no eval prompt has"):
        eval_set(
            Store(str(tmp_path / "r")), curated, ChatFormat(tokenizer), False, EvaluateConfig(categories=["poetry"])
        )
