"""KV-cached decoding equals the uncached reference: tokens, per-step acceptance (so tau), greedy.

Both drafter kinds, untrained and trained on the target's own continuations (so steps accept
0..all drafts and rollbacks happen), eos and max_new_tokens landing inside an accepted block,
several prompts. Tiny float32 models, so greedy argmax does not flip on rounding.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from draftflow.config import DrafterConfig, EvaluateConfig, TrainConfig
from draftflow.drafters.dflash.config import DFlashConfig
from draftflow.drafters.dflash.model import DFlashDrafter
from draftflow.drafters.dflash.spec import _block, draft_block
from draftflow.drafters.eagle3.config import Eagle3Config
from draftflow.drafters.eagle3.model import Eagle3Drafter, draft_chain
from draftflow.drafters.registry import spec_for_architecture
from draftflow.engines.capture import HFCapture
from draftflow.errors import LosslessError
from draftflow.evaluation import cached, decode
from draftflow.features import FeatureSample
from draftflow.layers import FINAL
from draftflow.training.loop import Start, train_drafter
from tests.conftest import MASK_ID, B

TAPS = [1, 2, 3]
NEW = 24  # generated tokens per prompt


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, MASK_ID, (6, 5), generator=g).tolist()


@pytest.fixture(scope="module")
def samples(target, prompts):
    """The target's own greedy continuations, with taps + the final normed state (EAGLE-3 needs it)."""
    seqs = [p + decode.greedy_generate(target, p, NEW, set()) for p in prompts]
    feats = HFCapture(target, [*TAPS, FINAL]).capture(seqs)
    mask = torch.tensor([0] * 5 + [1] * NEW, dtype=torch.bool)
    return [FeatureSample(f"s{i}", torch.tensor(s), mask, f) for i, (s, f) in enumerate(zip(seqs, feats))]


def _train(tmp_path_factory, target, cfg, samples, **kw):
    tcfg = TrainConfig(
        epochs=100, max_steps=60, batch_size=2, lr=3e-3, num_anchors=8, checkpoint_every=1000, device="cpu", seed=0
    )
    out = tmp_path_factory.mktemp("drafter")
    train_drafter(samples, target, cfg, tcfg, str(out), **kw)
    return out


def _configs(target):
    """DFlash (block 4, 3 taps) and EAGLE-3 (chain of 3, draft vocabulary = the first 200 ids) configs."""
    dcfg = DFlashConfig.from_target(
        target.config, DrafterConfig(num_layers=1, block_size=B, num_taps=3, target_layer_ids=TAPS), MASK_ID
    )
    ecfg = Eagle3Config.from_target(
        target.config, DrafterConfig(kind="eagle3", target_layer_ids=TAPS, ttt_steps=3), 200
    )
    return dcfg, ecfg


@pytest.fixture(scope="module")
def untrained(target):
    dcfg, ecfg = _configs(target)
    torch.manual_seed(1)
    return {"dflash": DFlashDrafter(dcfg, target).eval(), "eagle3": Eagle3Drafter(ecfg, target).eval(),
            "eagle3 2 layers": Eagle3Drafter(replace(ecfg, num_layers=2), target).eval()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, target, samples):
    """Both kinds trained on the target's own continuations: steps accept anything from 0 to all drafts."""
    dcfg, ecfg = _configs(target)
    vocab = (torch.zeros(200, dtype=torch.long), torch.arange(320) < 200)
    dflash_samples = [FeatureSample(s.sample_id, s.input_ids, s.loss_mask, s.hidden[:, :3]) for s in samples]
    return {
        "dflash": DFlashDrafter.load(_train(tmp_path_factory, target, dcfg, dflash_samples), target).eval(),
        "eagle3": Eagle3Drafter.load(_train(tmp_path_factory, target, ecfg, samples, start=Start(vocab)),
                                     target).eval(),
    }


KINDS = [("dflash", False), ("dflash", True), ("eagle3", False), ("eagle3", True)]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: f"{k[0]}-{'trained' if k[1] else 'untrained'}")
def test_cached_equals_uncached_tokens_and_steps(request, target, prompts, kind):
    drafter = request.getfixturevalue("trained" if kind[1] else "untrained")[kind[0]]
    lengths = []
    for p in prompts[:4]:
        ref = decode.speculative_generate(target, drafter, p, NEW, set())
        got = cached.speculative_generate_cached(target, drafter, p, NEW, set())
        assert got == ref, p
        lengths += got[1]
    if kind[1]:  # trained: both full blocks and rejections happened, so rollback was exercised
        assert max(lengths) >= 3 and min(lengths) == 1, lengths


def _multi_token_step(target, drafter, prompts):
    """(prompt, tokens, index of a token strictly inside a step that kept >= 2 tokens)."""
    for p in prompts:
        tokens, acc = decode.speculative_generate(target, drafter, p, NEW, set())
        start = 1  # token 0 comes from prefill
        for a in acc:
            inside = [i for i in range(start, start + a - 1) if tokens[i] not in tokens[:i]]
            if a >= 2 and inside:
                return p, tokens, inside[0]
            start += a
    raise AssertionError("no step kept two tokens: the trained drafter learned nothing")


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_eos_and_max_new_tokens_inside_a_block(target, trained, prompts, kind):
    drafter = trained[kind]
    p, tokens, i = _multi_token_step(target, drafter, prompts)
    eos = {tokens[i]}  # first occurrence, not the last token of its step: the cut lands inside the block
    ref = decode.speculative_generate(target, drafter, p, NEW, eos)
    assert ref[0] == tokens[: i + 1]
    assert cached.speculative_generate_cached(target, drafter, p, NEW, eos) == ref
    ref = decode.speculative_generate(target, drafter, p, i + 1, set())  # the cap inside the same block
    assert ref[0] == tokens[: i + 1] and 1 + sum(ref[1]) == i + 1
    assert cached.speculative_generate_cached(target, drafter, p, i + 1, set()) == ref
    assert cached.speculative_generate_cached(target, drafter, p, 1, set()) == (tokens[:1], [])


def test_cached_greedy_equals_uncached_greedy(target, prompts):
    for p in prompts[:3]:
        ref = decode.greedy_generate(target, p, 30, set())
        assert cached.greedy_generate_cached(target, p, 30, set()) == ref
        eos = {ref[7]}
        assert cached.greedy_generate_cached(target, p, 30, eos) == decode.greedy_generate(target, p, 30, eos)


def test_greedy_along_reads_greedy_off_one_forward(target, prompts):
    """A true greedy output comes back as it is (end ids and the cap included); every way of departing from greedy
    comes back as greedy up to and including its own token at the first departure, so check_lossless names it."""
    for p in prompts[:3]:
        ref = cached.greedy_generate_cached(target, p, 30, set())
        assert cached.greedy_along(target, p, ref, 30, set()) == ref
        eos = {ref[7]}
        cut = decode.greedy_generate(target, p, 30, eos)
        assert cached.greedy_along(target, p, cut, 30, eos) == cut and len(cut) <= 8
        assert cached.greedy_along(target, p, ref[:12], 12, set()) == ref[:12]  # ended by the cap
    p = prompts[0]
    ref = decode.greedy_generate(target, p, 30, set())
    wrong = ref[:5] + [(ref[5] + 1) % MASK_ID] + ref[6:]
    end = next(i for i in range(5, 30) if ref[i] not in ref[:i])  # an end id whose first occurrence is there
    cases = {
        "a different token": (wrong, set(), 30, 5),
        "stopped early": (ref[:20], set(), 30, 20),
        "went past an end id": (ref, {ref[end]}, 30, end + 1),
        "went past the cap": (ref, set(), 25, 25),
    }
    for name, (spec, eos, cap, at) in cases.items():
        got = cached.greedy_along(target, p, spec, cap, eos)
        assert got == decode.greedy_generate(target, p, cap, eos)[: at + 1], name
        with pytest.raises(LosslessError, match=f"generated position {at} "):
            decode.check_lossless(0, spec, got)


def test_evaluate_prompts_same_report_with_and_without_cache(target, trained, prompts):
    drafter = trained["dflash"]
    on = cached.evaluate_prompts(target, drafter, prompts, EvaluateConfig(max_new_tokens=16, num_prompts=3), set())
    off = cached.evaluate_prompts(
        target, drafter, prompts, EvaluateConfig(max_new_tokens=16, num_prompts=3, kv_cache=False), set()
    )
    assert on == off and on["tau"] > 1.0, on


def test_dflash_cached_forward_equals_forward(target, untrained):
    """The drafter's cached-context forward gives the uncached forward's logits (both layer kinds)."""
    drafter = untrained["dflash"]
    feats = torch.randn(11, drafter.config.num_taps * 64)
    block_ids, block_pos, ctx_pos, mask = _block(drafter, 7, 11)
    with torch.no_grad():
        full = drafter(block_ids, block_pos, feats[None], ctx_pos, mask)
        kv = drafter.context_kv(feats[None, :6], ctx_pos[:, :6])  # appended in two parts, as decoding does
        kv = [
            (torch.cat([k, k2], 2), torch.cat([v, v2], 2))
            for (k, v), (k2, v2) in zip(kv, drafter.context_kv(feats[None, 6:], ctx_pos[:, 6:]))
        ]
        torch.testing.assert_close(drafter.forward_cached(block_ids, block_pos, kv, ctx_pos, mask), full)
        sliding = DFlashDrafter(
            drafter.config.__class__.from_dict(
                drafter.config.to_dict() | {"layer_types": ["sliding_attention"], "sliding_window": 5}
            ),
            target,
        ).eval()
        sliding.load_state_dict(drafter.state_dict())
        full = sliding(block_ids, block_pos, feats[None], ctx_pos, mask)
        kv = sliding.context_kv(feats[None], ctx_pos)
        torch.testing.assert_close(sliding.forward_cached(block_ids, block_pos, kv, ctx_pos, mask), full)


@pytest.mark.parametrize("kind", ["dflash", "eagle3", "eagle3 2 layers"])
def test_cached_proposers_give_the_uncached_drafters_logits(target, untrained, prompts, kind):
    """Along a decoding trajectory (steps accepting 0..3 drafts), the cached proposer's logits equal the
    uncached proposer's: this catches what greedy tokens of a tiny model may hide (a RoPE position off by one)."""
    drafter = untrained[kind]
    seq = prompts[0] + decode.greedy_generate(target, prompts[0], 16, set())
    _, feats = decode.capture_taps(target, seq, drafter.config.target_layer_ids)
    proposer = spec_for_architecture(drafter.config.architecture).cached_proposer(drafter)
    done = 0
    for n in (5, 6, 9, 11, 12, 16, 20):  # the anchor sits at n; features up to n-1 are the context
        if kind == "dflash":
            got = proposer.block_logits(seq[:n], seq[n], feats[done:n])
            torch.testing.assert_close(got, draft_block(drafter, seq[n], feats[:n]), rtol=1e-5, atol=1e-5)
        else:
            got = proposer.chain(seq[:n], seq[n], feats[done:n])
            want = draft_chain(drafter, feats[:n], seq[1 : n + 1], drafter.config.ttt_steps)
            assert got[0] == want[0]
            torch.testing.assert_close(torch.stack(got[1]), torch.stack(want[1]), rtol=1e-5, atol=1e-5)
        done = n


def test_sliding_window_target_rolls_back_past_its_window():
    """A target with sliding-window layers (window 4, far shorter than the sequence): its cache keeps
    every position, so cropping rejected drafts works there too, and decoding equals the reference."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=2,
    )
    target = Qwen3ForCausalLM(cfg).eval()
    assert "sliding_attention" in cfg.layer_types
    dcfg = DFlashConfig.from_target(
        cfg, DrafterConfig(num_layers=1, block_size=B, num_taps=1, target_layer_ids=[1]), MASK_ID
    )
    drafter = DFlashDrafter(dcfg, target).eval()
    p = list(range(3, 10))
    assert cached.greedy_generate_cached(target, p, 16, set()) == decode.greedy_generate(target, p, 16, set())
    got = cached.speculative_generate_cached(target, drafter, p, 16, set())
    assert got == decode.speculative_generate(target, drafter, p, 16, set())
    assert got[0] == decode.greedy_generate(target, p, 16, set())


def test_a_wrong_acceptance_rule_is_caught_in_the_cached_loop(monkeypatch, target, untrained, prompts):
    """The cached loop accepts by decode's one rule, and its lossless check catches a wrong one."""
    real = decode._accept
    monkeypatch.setattr(decode, "_accept", lambda d, t: min(real(d, t) + 1, len(d)))  # one too many
    with pytest.raises(LosslessError, match=r"prompt 0: .* position \d+"):
        cached.evaluate_prompts(target, untrained["dflash"], prompts, EvaluateConfig(max_new_tokens=8), set())
