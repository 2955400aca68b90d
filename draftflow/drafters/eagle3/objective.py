"""The EAGLE-3 objective (arXiv 2503.01840): the training-time-test unroll of
`draftflow.drafters.eagle3.model`, step i's soft cross entropy against the target's distribution over the
draft vocabulary weighted `ttt_decay ** i` (the paper), or by what decoding reaches (`train.gamma: measured`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftflow.config import RECIPE_OBJECTIVE, DrafterConfig, TrainConfig
from draftflow.drafters.batches import sampled_vocab, step_generator
from draftflow.drafters.eagle3.batches import Eagle3Batch, make_eagle3_batch
from draftflow.drafters.eagle3.config import Eagle3Config
from draftflow.drafters.eagle3.pruned import Scoring, leading, read_positions, scored_rows
from draftflow.drafters.eagle3.settings import Eagle3Settings
from draftflow.drafters.objectives import (
    REACH_FLOOR,
    LossStats,
    ObjectiveOptions,
    chain_gain,
    reach,
    slot_terms,
    top_k_targets,
)
from draftflow.features import FeatureSample

IN_VOCAB_KEPT = 64 * 2**20  # positions whose in-vocabulary flag training keeps (`Eagle3Objective._keep_in_vocab`)

# `train.gamma: measured` (draftflow recipe's default): unroll step i weighs the measured probability that decoding
# reaches draft i+1, P(the drafts before it accepted), from each held-out measurement (as DFlash's slots), and the
# unroll stops at the last step decoding reaches at least `REACH_FLOOR` of the time: every step is a whole pass of
# the layer and the draft-vocabulary head over every position, and at tau ~1.3 steps 4-7 are reached under 0.5% of
# the time (held out on SmolLM2: acceptance 0.26, 0.05, 0.004, 0.0005, 0, 0, 0): unrolling 2-4 of 7 steps trained
# 0.54 steps/s against 0.35 there, and the unroll deepens as acceptance grows. Held-out measurements count every
# step (`accepted`: the unroll pruned to the rows still accepting, which is exact). The paper's fixed 0.8 ** i spreads
# the loss over all 7 (ttt_decay 0.5 beat 0.8 held out: 1.344 against 1.312, docs/results.md "Recipes").


def reach_steps(acceptance: list[float], steps: int) -> list[float]:
    """Loss weights of the unroll steps decoding reaches (`acceptance[k-1]` = P(at least k drafts accepted)): step 0
    weighs 1, step i P(at least i accepted); the list ends before the first step reached under `REACH_FLOOR` of the
    time (at least one step)."""
    weights = reach(acceptance, steps)
    return weights[: next((i for i, r in enumerate(weights) if i and r < REACH_FLOOR), steps)]


def every_row(logits: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`unroll`'s logits (1, R, Vd) per step as the losses read them, (rows, logits) per step: step i's rows with a
    target position, 0..R-1-i (`scored_unroll` gives the rows scored only, which the losses count the same)."""
    R = logits[0].shape[1] if logits else 0
    return [(torch.arange(R - i, device=lg.device), lg[:, : R - i]) for i, lg in enumerate(logits)]


def _placed(rows: torch.Tensor, values: torch.Tensor, R: int) -> torch.Tensor:
    """(R,) `values` at `rows`, zero (False) elsewhere; differentiable in `values`."""
    return values.new_zeros(R).index_put((rows,), values)


def eagle3_loss(logits: list[tuple[torch.Tensor, torch.Tensor]], probs: torch.Tensor, in_vocab: torch.Tensor,
                supervised: torch.Tensor, weights: list[float], steps: int | None = None) -> LossStats:
    """Decayed soft cross entropy over the unroll steps, plus accuracy statistics.

    Args:
        logits: per unrolled step, (rows (n,), the drafter's logits there (1, n, Vd)): `every_row` of `unroll`'s,
            or `scored_unroll`'s (only the rows that count; the same loss).
        probs: (1, T, Vd) the target's distribution over the draft vocabulary at every position;
            step i, row t is scored against position t+1+i.
        in_vocab: (1, T) the target's argmax at that position is a draft token.
        supervised: (1, K, R) bool from `make_eagle3_batch`.
        weights: step i's loss weight (the paper: ttt_decay ** i).
        steps: the length of the statistics (the drafter's ttt_steps; steps not unrolled count nothing); None = K.

    Returns:
        `LossStats` per step (correct/valid of length `steps`; a row's leading count stops at its first
        wrong or unsupervised step; rows = those supervised at step 0). `weight_sum` counts the
        supervised rows; rows whose target argmax is outside the draft vocabulary add nothing to
        `weighted_sum` but stay in `weight_sum` (known before the forward pass, like SpecForge's
        mean over positions).
    """
    R = supervised.shape[-1]
    weighted_sum = probs.new_zeros((), dtype=torch.float32)
    hits, valids, weight_sum = [], [], 0.0
    for i, (rows, lg) in enumerate(logits):
        p = probs[0, 1 + i + rows]  # (n, Vd)
        valid = supervised[0, i, rows] & in_vocab[0, 1 + i + rows]  # (n,)
        ce = -(p * F.log_softmax(lg[0].float(), dim=-1)).sum(-1)  # (n,)
        w = weights[i]
        weighted_sum = weighted_sum + w * (ce * valid).sum()
        weight_sum += w * float(supervised[:, i].sum())
        hits.append(_placed(rows, (lg[0].detach().argmax(-1) == p.argmax(-1)) & valid, R))
        valids.append(_placed(rows, valid, R))
    hit, valid = torch.stack(hits), torch.stack(valids)  # (K, R)
    leading = hit.int().cumprod(dim=0).sum(dim=0)[supervised[0, 0] & in_vocab[0, 1:]]  # rows valid at step 0
    pad = (0, 0, 0, (steps or len(logits)) - len(logits))
    hit, valid = F.pad(hit, pad), F.pad(valid, pad)
    return LossStats(
        loss=weighted_sum / max(weight_sum, 1e-12),
        weighted_sum=weighted_sum,
        weight_sum=weight_sum,
        correct=hit.sum(1).cpu().double(),
        valid=valid.sum(1).cpu().double(),
        leading=leading.cpu(),
    )


def eagle3_options_loss(logits: list[tuple[torch.Tensor, torch.Tensor]], probs: torch.Tensor, in_vocab: torch.Tensor,
                        supervised: torch.Tensor, weights: list[float], options: ObjectiveOptions,
                        steps: int | None = None) -> LossStats:
    """`eagle3_loss` with the `ObjectiveOptions`: labels the target's top-k (k = 0: its argmax alone) instead of
    its whole distribution, and/or the acceptance-oriented loss (`objectives.chain_gain` over the unroll: step
    i's draft is accepted only if steps 0..i-1 were). Same inputs, statistics and normalisation as `eagle3_loss`."""
    R, K = supervised.shape[-1], len(logits)
    k = options.distill_top_k
    terms, alphas, valids, hits, weight_sum = [], [], [], [], 0.0
    for i, (rows, lg) in enumerate(logits):
        p = probs[0, 1 + i + rows]  # (n, Vd)
        n = p.shape[0]
        valid = supervised[0, i, rows] & in_vocab[0, 1 + i + rows]
        if k is None:  # the whole distribution (the paper): its support is every draft token
            soft = (torch.arange(p.shape[-1], device=p.device).expand(n, -1), p)
        elif k == 0:  # hard labels: the target's argmax alone
            soft = (p.argmax(-1, keepdim=True), p.new_ones(n, 1))
        else:
            soft = top_k_targets(p.log(), k)
        term, alpha = slot_terms(lg[0], p.argmax(-1), soft, options.acceptance_loss)
        terms.append(_placed(rows, term, R))
        alphas.append(_placed(rows, alpha, R))
        valids.append(_placed(rows, valid, R))
        hits.append(_placed(rows, (lg[0].detach().argmax(-1) == p.argmax(-1)) & valid, R))
        weight_sum += weights[i] * float(supervised[:, i].sum())
    term, alpha, valid, hit = (torch.stack(x, dim=1) for x in (terms, alphas, valids, hits))  # (R, K)
    w = torch.tensor(weights[:K], device=term.device)[None, :] * valid
    if options.acceptance_loss:
        w = w + chain_gain(alpha, valid.float())
    weighted_sum = torch.where(valid, term * w, 0.0).sum()
    leading = hit.int().cumprod(dim=1).sum(dim=1)[supervised[0, 0] & in_vocab[0, 1:]]
    pad = (0, (steps or K) - K)
    hit, valid = F.pad(hit, pad), F.pad(valid, pad)
    return LossStats(
        loss=weighted_sum / max(weight_sum, 1e-12),
        weighted_sum=weighted_sum,
        weight_sum=weight_sum,
        correct=hit.sum(0).cpu().double(),
        valid=valid.sum(0).cpu().double(),
        leading=leading.cpu(),
    )


class Eagle3Objective:
    """EAGLE-3: the training-time-test unroll, soft targets over the draft vocabulary."""

    def __init__(self, cfg: Eagle3Config, tcfg: TrainConfig, drafter: DrafterConfig | None = None):
        self.cfg, self.n_slots = cfg, cfg.ttt_steps
        # the steps unrolled in training and their weights: the paper's decay over every step until the first
        # held-out measurement under `train.gamma: measured` (then `reweight`), always without it
        self.measured = tcfg.gamma == "measured"
        self.step_weights = [cfg.ttt_decay**i for i in range(cfg.ttt_steps)]
        self.options = ObjectiveOptions(cfg.distill_top_k, cfg.acceptance_loss)
        self._choices: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # held-out sequence -> `target_choice`
        self._in_vocab: dict[str, torch.Tensor] = {}  # training sequence -> where the target's argmax is a draft token
        self._in_vocab_positions = 0
        # which positions the loss scores (`drafter.draftable`): "tokens" reads them off the sequence, never running
        # the target's whole head (on the rehearsal's data the two rules agree at 99.98% of positions, and the whole
        # head was a tenth of a 1,200-step run: a first visit's ~0.08 s of a ~0.23 s step)
        own = None if drafter is None else drafter.own(Eagle3Settings).draftable
        self.draftable = own or RECIPE_OBJECTIVE[tcfg.recipe]["draftable"]["eagle3"]
        # train.sampled_softmax: the draft ids always scored (set by the loop: tokenize's supervised tokens)
        self.sampled, self.seed = tcfg.sampled_softmax, tcfg.seed
        self.loss_tokens: torch.Tensor | None = None

    def reweight(self, acceptance: list[float]) -> None:
        """After a held-out measurement (and on resume, from the history): under `train.gamma: measured`, unroll
        only the steps decoding reaches, each weighted by its reach (`reach_steps`)."""
        if self.measured:
            self.step_weights = reach_steps(acceptance, self.cfg.ttt_steps)

    def batch(self, sample: FeatureSample, step: int, j: int) -> Eagle3Batch | None:
        """Every row (deterministic); under `train.sampled_softmax` the draft ids its head scores: every supervised
        token's (`loss_tokens`, in draft ids) and that many others drawn from the rest of the draft vocabulary."""
        b = make_eagle3_batch(sample, len(self.step_weights))
        if b is not None and self.sampled and self.loss_tokens is not None:  # the step's generator: resumable
            b.vocab, b.vocab_bias = sampled_vocab(self.loss_tokens[:0], self.loss_tokens, self.cfg.draft_vocab_size,
                                                  self.sampled, step_generator(self.seed, step, j))
            if b.vocab.numel() == self.cfg.draft_vocab_size:  # the data fills the draft vocabulary: the whole head
                b.vocab = b.vocab_bias = None
        return b

    def heldout_batch(self, sample: FeatureSample, j: int) -> Eagle3Batch | None:
        return make_eagle3_batch(sample, self.cfg.ttt_steps)

    def weight(self, b: Eagle3Batch) -> float:
        """The loss's normaliser, known before the forward pass: the paper's decayed count of supervised rows; under
        `train.gamma: measured` the rows of step 0 (the loss sums each row's chain over the steps decoding reaches:
        the step-0 loss plus what the reached later steps add)."""
        if self.measured:
            return float(b.supervised[0, 0].sum())
        unrolled = self.step_weights[: b.supervised.shape[1]]
        return sum(d * float(b.supervised[0, i].sum()) for i, d in enumerate(unrolled))

    def loss(self, drafter, b: Eagle3Batch) -> LossStats:
        """A training batch unrolls `len(self.step_weights)` steps, a held-out one every step (weighed as the paper's
        decay beyond the trained steps: its loss is not used, only its statistics). Under `train.gamma: measured`
        step i >= 1 runs only the rows decoding reaches (`Scoring.reached`) and each weighs 1: the rows present are
        the reach (`weight` counts step 0's rows)."""
        known = next_token_draftable(b, drafter.t2d) if self.draftable == "tokens" else self._in_vocab.get(b.key)
        columns = None if b.vocab is None else (b.vocab, b.vocab_bias)
        logits, probs, in_vocab = drafter(b.feats, b.step_ids, b.pos, b.final, b.read,
                                          None if known is None else known.to(b.final.device),
                                          Scoring(b.supervised, columns, reached=self.measured))
        if self.draftable == "target":
            self._keep_in_vocab(b.key, in_vocab, known)
        if self.measured:  # each reached row weighs 1
            weights = [1.0] * len(logits)
        else:
            weights = self.step_weights + [self.cfg.ttt_decay**i for i in range(len(self.step_weights), len(logits))]
        if self.options.distill_top_k is None and not self.options.acceptance_loss:  # the paper's recipe
            return eagle3_loss(logits, probs, in_vocab, b.supervised, weights, self.n_slots)
        return eagle3_options_loss(logits, probs, in_vocab, b.supervised, weights, self.options, self.n_slots)

    def _keep_in_vocab(self, key: str, in_vocab: torch.Tensor, known: torch.Tensor | None) -> None:
        """Keep a sequence's `in_vocab` (the target's whole head over fixed features: the same at every visit), so
        later visits run only the head's draft rows: ~0.06 s of a ~0.4 s step on SmolLM2 from its second epoch. Up to
        `IN_VOCAB_KEPT` positions (a byte each); beyond that a visit computes it again."""
        if known is None and key and self._in_vocab_positions + in_vocab.numel() <= IN_VOCAB_KEPT:
            self._in_vocab[key] = in_vocab.cpu()
            self._in_vocab_positions += in_vocab.numel()

    def accepted(self, drafter, b: Eagle3Batch, key: int) -> torch.Tensor:
        """A held-out sequence's accepted drafts per row (`heldout.measure`; as `loss(...).leading` counts them), by
        the drafter's pruned unroll (`pruned.leading`); the target's choices are kept by `key` (the frozen
        head over fixed features: the same at every measurement, ~a quarter of one)."""
        if key not in self._choices:
            self._choices[key] = tuple(t.cpu() for t in target_choice(drafter, b))
        choice, valid = (t.to(b.feats.device) for t in self._choices[key])
        return leading(drafter, b.feats, b.step_ids, b.pos, choice, valid).cpu()


def next_token_draftable(b: Eagle3Batch, t2d: torch.Tensor) -> torch.Tensor:
    """(1, T) the `in_vocab` flags of `drafter.draftable: tokens`: at each position read, whether the sequence's next
    token (step 0's input of the row there, `make_eagle3_batch`) is a draft token; False elsewhere."""
    nxt = b.step_ids[:, 0]  # (1, R): x_{p+1} at position p < R = T-1 (the last position is never read)
    flags = torch.zeros_like(b.read)
    flags[:, : nxt.shape[1]] = t2d[nxt.clamp(max=t2d.numel() - 1)] & (nxt < t2d.numel())
    return flags & b.read


def target_choice(drafter, b: Eagle3Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, K, R) the target's greedy token in draft ids that step i, row t is checked against, and (1, K, R) where it
    counts (`scored_rows`: supervised, the target's argmax a draft token)."""
    probs, in_vocab = drafter.soft_targets_at(b.final, b.read)
    at = read_positions(*b.supervised.shape[1:], probs.shape[1], probs.device)
    return probs[0].argmax(-1)[at][None], scored_rows(b.supervised, in_vocab)
