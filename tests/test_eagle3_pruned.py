"""EAGLE-3's unroll run only where it counts, and the training-side savings built on it: the rows a loss scores
(`pruned.scored_unroll`), the rows still accepting (`pruned.leading`), the target's in-vocabulary flags kept per
sequence, and the sampled head (`train.sampled_softmax`). Each is checked against the whole unroll or the whole head.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from draftflow.config import DrafterConfig
from draftflow.drafters.eagle3.batches import make_eagle3_batch
from draftflow.drafters.eagle3.model import Eagle3Drafter, ttt_attention_mask
from draftflow.drafters.eagle3.objective import Eagle3Objective, eagle3_loss, every_row, next_token_draftable
from draftflow.drafters.eagle3.pruned import Scoring, leading, scored_rows, scored_unroll, with_exact
from draftflow.drafters.eagle3.vocab import draft_ids
from draftflow.features import FeatureSample
from draftflow.training.loop import Start, train_drafter
from tests.eagle3_setup import VD, K, drafter, ecfg, samples, tcfg, vocab  # noqa: F401  (fixtures)

# ----------------------------------------------------------------------------- the pruned unroll


def test_the_pruned_unroll_counts_what_the_whole_unroll_accepts(drafter, samples):
    # the target's choice agrees with the drafter's own argmax at ~70% of the slots, so rows accept 0..K drafts
    g, seen = torch.Generator().manual_seed(3), Counter()
    for sample in samples:
        b = make_eagle3_batch(sample, K)
        own = torch.stack([lg.argmax(-1) for lg in drafter.unroll(b.feats, b.step_ids, b.pos)], dim=1)  # (1, K, R)
        choice = torch.where(torch.rand(own.shape, generator=g) < 0.7, own, (own + 1) % VD)
        want = ((own == choice) & b.supervised)[0].int().cumprod(0).sum(0)[b.supervised[0, 0]]
        got = leading(drafter, b.feats, b.step_ids, b.pos, choice, b.supervised)
        assert torch.equal(got, want)
        seen.update(got.tolist())
    assert set(seen) == set(range(K + 1))  # every depth, so the pruning was exercised




def test_the_scored_unroll_gives_the_whole_unrolls_loss_and_gradients(drafter, samples):
    """Training runs step i >= 1 only on the rows some later step scores and the head only where step i scores: the
    loss, its statistics and every parameter's gradient are the whole unroll's."""
    params = [p for p in drafter.parameters() if p.requires_grad]
    for sample in samples:
        b = make_eagle3_batch(sample, K)
        probs, in_vocab = drafter.soft_targets_at(b.final, b.read)
        in_vocab[0, 7] = False  # a target argmax outside the draft vocabulary: its rows are not scored
        results = []
        for pruned in (False, True):
            if pruned:
                logits = scored_unroll(drafter, b.feats, b.step_ids, b.pos, scored_rows(b.supervised, in_vocab))
            else:
                logits = every_row(drafter.unroll(b.feats, b.step_ids, b.pos))
            st = eagle3_loss(logits, probs, in_vocab, b.supervised, [0.8**i for i in range(K)])
            results.append((st, torch.autograd.grad(st.loss, params), sum(lg.shape[1] for _, lg in logits)))
        (whole, g1, rows_whole), (scored, g2, rows_scored) = results
        assert rows_scored < rows_whole  # the prompt's rows and the steps' tails were left out
        torch.testing.assert_close(scored.loss, whole.loss, rtol=1e-5, atol=1e-6)
        assert torch.equal(scored.correct, whole.correct) and torch.equal(scored.valid, whole.valid)
        assert torch.equal(scored.leading, whole.leading)
        for x, y in zip(g1, g2):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-6)




def test_training_unrolls_a_step_only_on_the_rows_whose_drafts_before_it_were_accepted(drafter, samples):
    """`train.gamma: measured`: decoding never verifies a draft after a rejected one, so neither does training."""
    g, depths = torch.Generator().manual_seed(5), Counter()
    for sample in samples:
        b = make_eagle3_batch(sample, K)
        scored = scored_rows(b.supervised, drafter.soft_targets_at(b.final, b.read)[1])[0]  # (K, R)
        with torch.no_grad():
            whole = drafter.unroll(b.feats, b.step_ids, b.pos)
        own = torch.stack([lg[0].argmax(-1) for lg in whole])  # (K, R) the drafter's own drafts
        choice = torch.where(torch.rand(own.shape, generator=g) < 0.7, own, (own + 1) % VD)
        reached = scored.clone()
        for i in range(1, K):  # scored, and every earlier step scored and accepted
            reached[i] &= reached[i - 1] & (own[i - 1] == choice[i - 1])
        with torch.no_grad():
            got = scored_unroll(drafter, b.feats, b.step_ids, b.pos, scored[None], None, choice)
        for i, (rows, logits) in enumerate(got):
            assert torch.equal(rows, reached[i].nonzero().squeeze(1)), i
            torch.testing.assert_close(logits[0], whole[i][0, rows], rtol=1e-5, atol=1e-5)
            depths[i] += rows.numel()
    assert depths[0] > depths[1] > depths[2] > 0  # fewer rows each step, and some at every step


def test_a_second_visit_reuses_the_targets_choices_and_scores_the_same(drafter, samples, ecfg):
    objective = Eagle3Objective(ecfg, tcfg(), DrafterConfig(kind="eagle3", draftable="target"))
    b = objective.batch(samples[0], 0, 0)
    first = objective.loss(drafter, b)
    assert list(objective._in_vocab) == [samples[0].sample_id]
    second = objective.loss(drafter, b)  # the kept in_vocab: only the target head's draft rows run
    assert torch.equal(first.weighted_sum, second.weighted_sum) and torch.equal(first.correct, second.correct)
    objective._in_vocab[b.key] = ~objective._in_vocab[b.key]  # a wrong kept flag would change what is scored
    assert not torch.equal(objective.loss(drafter, b).valid, first.valid)



@pytest.mark.parametrize("recipe, draftable, want", [("draftflow", None, "tokens"), ("paper", None, "target"),
                                                     ("paper", "tokens", "tokens"), ("draftflow", "target", "target")])
def test_the_positions_scored_follow_the_recipe_unless_set(ecfg, recipe, draftable, want):
    section = DrafterConfig(kind="eagle3", draftable=draftable)
    assert Eagle3Objective(ecfg, tcfg(recipe=recipe), section).draftable == want


def test_positions_read_off_the_tokens_score_as_the_targets_own_and_never_run_its_whole_head(drafter, samples, ecfg):
    """The samples are the target's greedy answers: its argmax is the next token, so both rules flag the same
    positions and the loss is the same; under `tokens` the target's 320-row head never runs."""
    by_target = Eagle3Objective(ecfg, tcfg(), DrafterConfig(kind="eagle3", draftable="target"))
    by_tokens = Eagle3Objective(ecfg, tcfg(), DrafterConfig(kind="eagle3", draftable="tokens"))
    whole_head = []
    hook = drafter.target_head.register_forward_hook(lambda m, i, o: whole_head.append(i[0].shape))
    try:
        for j, sample in enumerate(samples):
            b = by_target.batch(sample, 0, j)
            want = by_target.loss(drafter, b)
            assert len(whole_head) == j + 1  # the target rule: one whole-head pass a first visit
            flags = next_token_draftable(b, drafter.t2d)
            assert torch.equal(flags, by_target._in_vocab[b.key]) and flags.any()
            got = by_tokens.loss(drafter, by_tokens.batch(sample, 0, j))
            assert torch.equal(got.weighted_sum, want.weighted_sum) and torch.equal(got.valid, want.valid)
        assert len(whole_head) == len(samples)
    finally:
        hook.remove()


def test_a_next_token_outside_the_draft_vocabulary_is_not_scored(drafter, samples):
    b = make_eagle3_batch(samples[0], K)
    outside = int((~drafter.t2d).nonzero()[0])
    p = int(b.read[0].nonzero()[0])  # a position read: its next token x_{p+1} is step 0's input at row p
    assert next_token_draftable(b, drafter.t2d)[0, p]
    b.step_ids[0, 0, p] = outside
    flags = next_token_draftable(b, drafter.t2d)
    assert not flags[0, p] and flags[0, p + 1:].equal(next_token_draftable(make_eagle3_batch(samples[0], K),
                                                                          drafter.t2d)[0, p + 1:])


def test_held_out_acceptance_by_the_pruned_unroll_equals_the_losss_count(drafter, samples, ecfg):
    # the state below is not the target's, so its argmax is not the next token: the loss counts as held out does
    objective = Eagle3Objective(ecfg, tcfg(), DrafterConfig(kind="eagle3", draftable="target"))
    total = 0
    for j, sample in enumerate(samples):
        with torch.no_grad():  # the target's final state made the drafter's own step-0 state: step 0 mostly accepts
            b = objective.heldout_batch(sample, j)
            mask = ttt_attention_mask(b.feats.shape[1], 0)[None]
            state, _ = drafter.step(b.step_ids[:, 0], drafter.fc(b.feats), b.pos, [], mask)
            hidden = sample.hidden.clone()
            hidden[1:, 3] = drafter.norm(state[0])
        b = objective.heldout_batch(FeatureSample(sample.sample_id, sample.input_ids, sample.loss_mask, hidden), j)
        want = objective.loss(drafter, b).leading
        assert torch.equal(objective.accepted(drafter, b, j), want)
        assert torch.equal(objective.accepted(drafter, b, j), want)  # again, from the kept target choices
        total += int(want.sum())
    assert total > 0 and j + 1 == len(objective._choices)


# ----------------------------------------------------------------------------- the sampled head


def test_the_sampled_head_scoring_every_draft_token_is_the_whole_heads_loss(drafter, samples, ecfg):
    whole, sampled = Eagle3Objective(ecfg, tcfg()), Eagle3Objective(ecfg, tcfg(sampled_softmax=10_000))
    sampled.loss_tokens = torch.tensor([3, 4, 5])
    b = sampled.batch(samples[0], 0, 0)
    assert b.vocab is None  # every draft id drawn: the whole head, no columns
    b.vocab, b.vocab_bias = torch.arange(VD), torch.zeros(VD)
    one, two = whole.loss(drafter, whole.batch(samples[0], 0, 0)), sampled.loss(drafter, b)
    assert two.loss.item() == pytest.approx(one.loss.item(), rel=1e-6)
    assert torch.equal(one.correct, two.correct) and torch.equal(one.valid, two.valid)


def test_the_sampled_head_scores_fewer_columns_keeps_every_target_choice_and_trains(tmp_path, drafter, samples, ecfg,
                                                                                    target, vocab):
    objective = Eagle3Objective(ecfg, tcfg(sampled_softmax=8, recipe="paper"))  # every row: comparable counts
    objective.loss_tokens = torch.arange(0, VD, 4)  # a quarter of the draft vocabulary always scored
    b = objective.batch(samples[0], 0, 0)
    assert b.vocab.numel() == VD // 4 + 8 and torch.equal(objective.batch(samples[0], 0, 0).vocab, b.vocab)
    assert not torch.equal(objective.batch(samples[0], 1, 0).vocab, b.vocab)  # another step draws others
    logits, probs, in_vocab = drafter(b.feats, b.step_ids, b.pos, b.final, b.read, None,
                                      Scoring(b.supervised, (b.vocab, b.vocab_bias)))
    assert VD // 4 + 8 <= probs.shape[-1] < VD and all(lg.shape[-1] == probs.shape[-1] for _, lg in logits)
    whole = Eagle3Objective(ecfg, tcfg(recipe="paper")).loss(drafter, make_eagle3_batch(samples[0], K))
    # the target's choice at every scored row is a column, so the hits are the whole head's where the drafter's
    # own argmax is among the columns, and never more
    assert torch.equal(objective.loss(drafter, b).valid, whole.valid)
    kw = dict(max_steps=40, batch_size=2, recipe="paper")  # the paper's loss: one scale from step to step
    got = train_drafter(samples, target, ecfg, tcfg(sampled_softmax=8, **kw), str(tmp_path / "s"),
                        start=Start(vocab, loss_tokens=objective.loss_tokens))
    train_drafter(samples, target, ecfg, tcfg(**kw), str(tmp_path / "w"), start=Start(vocab))
    assert got["loss"] < got["first_loss"]
    s, w = (Eagle3Drafter.load(tmp_path / d, target).fc.weight for d in ("s", "w"))
    assert not torch.equal(s, w)


def test_a_drawn_column_that_is_the_targets_choice_is_scored_exactly():
    ids, bias = with_exact(torch.tensor([1, 4, 9]), torch.tensor([0.0, 2.0, 2.0]), torch.tensor([9, 7, 7]))
    assert ids.tolist() == [1, 4, 7, 9] and bias.tolist() == [0.0, 2.0, 0.0, 0.0]


def test_the_always_scored_tokens_are_given_in_draft_ids(vocab):
    d2t, t2d = vocab
    supervised = torch.tensor([int(t2d.nonzero()[5]), int((~t2d).nonzero()[0]), int(t2d.nonzero()[-1])])
    got = draft_ids(supervised, t2d)
    assert got.tolist() == [5, VD - 1]  # a token outside the draft vocabulary has no draft id
    assert torch.equal(got + d2t[got], supervised[[0, 2]])
