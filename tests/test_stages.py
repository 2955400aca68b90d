"""Regenerate, tokenize and extract on the tiny target, through the library only."""

import torch

from draftflow.chat import ChatFormat
from draftflow.data.schema import read_rows
from draftflow.engines import SamplingParams
from draftflow.engines.dialogs import plan_dialog, split_reasoning
from draftflow.engines.hf import HFEngine
from draftflow.features import FeatureShard
from draftflow.stages import extract
from draftflow.stages.common import Source
from draftflow.stages.registry import stamp
from tests.conftest import run_front


def test_plan_dialog_regenerates_every_assistant_turn_in_place():
    row = {"messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}, {"role": "user", "content": "u3"}]}
    d = plan_dialog(row)
    assert [[m["content"] for m in g] for g in d.groups] == [["s", "u1"], ["u2"], ["u3"]]
    assert split_reasoning("<think>\nhmm\n</think>\n\nYes") == ("hmm", "Yes")
    assert split_reasoning("Yes") == (None, "Yes")


def test_batched_generation_equals_one_by_one(tiny_target):
    engine = HFEngine.load(tiny_target.path)
    chat = ChatFormat(engine.tokenizer)
    prompts = [chat.prompt_ids([{"role": "user", "content": q}], enable_thinking=False)
               for q in ("Hi", "What is the capital of France?", "Name three primary colors, please.")]
    params = SamplingParams(max_new_tokens=12)
    batched = engine.generate_ids(prompts, params)
    single = [engine.generate_ids([p], params)[0] for p in prompts]
    assert [c.ids for c in batched] == [c.ids for c in single]
    assert all(c.finish_reason in ("stop", "length") and c.ids for c in batched)
    assert all(t < len(engine.tokenizer) for c in batched for t in c.ids)


def test_regenerate_tokenize_supervise_exactly_the_generated_ids(tiny_cfg, tiny_target):
    store, shard, rfp, rres, tres = run_front(tiny_cfg, tiny_target)
    regen = read_rows(store.stage_path("regenerate", rfp, rres.shard.name))
    src = read_rows(store.stage_path("curate", stamp(tiny_cfg, "curate", {}).fingerprint, shard.name))
    assert len(regen) == len(src) == rres.rows_out
    for r, s in zip(regen, src):
        n_assistant = sum(m["role"] == "assistant" for m in s["messages"])
        assert sum(m["role"] == "assistant" for m in r["messages"]) == n_assistant
        assert all(g["ids"] for g in r["generated"]) and r["sample_id"] == s["sample_id"]
        assert '"target_fingerprint"' in r["provenance"] and r["finish_reason"] in ("stop", "length")
    toks = read_rows(store.stage_path("tokenize", "tokfp", tres.shard.name))
    generated = {(r["sample_id"], g["turn"]): g["ids"] for r in regen for g in r["generated"]}
    for t in toks:
        ids, mask = t["input_ids"], t["loss_mask"]
        assert sum(mask) > 0
        spans, cur = [], []
        for i, m in zip(ids, mask):
            if m:
                cur.append(i)
            elif cur:
                spans.append(cur)
                cur = []
        spans += [cur] if cur else []
        want = [generated[(t["sample_id"], turn)][: len(s)] for turn, s in zip(t["turns"], spans)]
        assert spans == want
    freq = read_rows(store.stage_path("tokenize", "tokfp", tres.info["freq"].name))
    assert sum(r["count"] for r in freq) == sum(sum(t["loss_mask"]) for t in toks)


def test_extract_matches_hf_hidden_states_at_l_plus_1(tiny_cfg, tiny_target):
    store, shard, rfp, rres, tres = run_front(tiny_cfg, tiny_target)
    cfg = tiny_cfg.model_copy(update={"extract": tiny_cfg.extract.model_copy(update={"dtype": "float32"})})
    eres = extract.run_shard(store, "exfp", cfg, tiny_target, Source("tokenize", "tokfp"), tres.shard)
    fs = FeatureShard(store.stage_path("extract", "exfp", eres.shard.name))
    toks = read_rows(store.stage_path("tokenize", "tokfp", tres.shard.name))
    assert len(fs) == len(toks) and fs.layer_ids == [1, 3, 5]
    from draftflow.target import load_target

    model, _ = load_target(tiny_target.path)
    sample = fs.get(f"{toks[0]['sample_id']}:{toks[0]['row']}")
    ref = model(torch.tensor([toks[0]["input_ids"]]), output_hidden_states=True).hidden_states
    for i, layer in enumerate(fs.layer_ids):
        torch.testing.assert_close(sample.hidden[:, i], ref[layer + 1][0], atol=1e-4, rtol=1e-4)
        assert not torch.allclose(sample.hidden[:, i], ref[layer][0], atol=1e-3)  # off by one differs
    assert sample.input_ids.tolist() == toks[0]["input_ids"]
