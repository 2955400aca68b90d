"""EAGLE-3's unroll run only where it counts (`draftflow.drafters.eagle3.model` writes the unroll down): in training the
rows a loss scores and the head's columns a sampled softmax draws (`scored_unroll`), in a held-out measurement the rows
still accepting (`leading`). Exact where it runs: row t of unroll step i reads step 0's keys up to its own and its own
earlier steps' (the unroll mask), so the rows left out cannot change it (tests/test_eagle3_pruned.py checks both
against the whole unroll).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Scoring:
    """What a training forward scores (`Eagle3Drafter.forward`, then `scored_unroll`)."""

    supervised: torch.Tensor  # (1, K, R) bool (`make_eagle3_batch`)
    columns: tuple[torch.Tensor, torch.Tensor] | None = None  # train.sampled_softmax: (sorted draft ids, log-Q bias)
    # step i+1 runs only the rows whose step-i draft the target chose (decoding reaches no other; `scored_unroll`)
    reached: bool = False


def read_positions(K: int, R: int, T: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(K, R) the position whose target distribution step i, row t is scored against: t+1+i (the module docstring),
    clamped to the last of T positions (rows past the end are never supervised)."""
    at = torch.arange(R, device=device)[None, :] + 1 + torch.arange(K, device=device)[:, None]
    return at.clamp(max=T - 1)


def scored_rows(supervised: torch.Tensor, in_vocab: torch.Tensor) -> torch.Tensor:
    """(1, K, R) the unroll's rows a loss scores: supervised (1, K, R), and the target's argmax at the position step i,
    row t is scored against a draft token (`in_vocab` (1, T))."""
    return supervised & in_vocab[:, read_positions(*supervised.shape[1:], in_vocab.shape[1], supervised.device)]


def with_exact(vocab: torch.Tensor, bias: torch.Tensor, exact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampled softmax's (ids, log-Q bias) with the ids `exact` added, or their bias zeroed where already drawn."""
    extra = exact.unique()
    extra = extra[~torch.isin(extra, vocab)]
    ids, order = torch.cat([vocab, extra]).sort()
    bias = torch.cat([bias.masked_fill(torch.isin(vocab, exact), 0.0), bias.new_zeros(extra.numel())])[order]
    return ids, bias


def pruned(drafter, feats: torch.Tensor, step_ids: torch.Tensor, pos: torch.Tensor, keep) -> None:
    """The unroll with step i >= 1 run only on some rows (B = 1; `unroll`'s inputs): `keep(i, rows, hidden)` gets
    step i's rows (n,) and their output hidden (1, n, D) and returns which of them step i+1 runs ((n,) bool).
    Exact for every row it runs: a row of step i reads step 0's keys up to its own and its own earlier steps'
    (the unroll mask), so the rows left out cannot change it. Step 0 runs every row: they are its keys."""
    R, K = feats.shape[1], step_ids.shape[1]
    hidden = drafter.fc(feats.to(drafter.fc.weight.dtype))
    rows = torch.arange(R, device=feats.device)
    causal = rows[:, None] >= rows[None, :]  # step 0's keys up to the row
    past: list[tuple[torch.Tensor, ...]] = []  # each step's keys/values (`Eagle3Drafter.step`)
    for i in range(K):
        mask = torch.cat([causal] + [torch.eye(rows.numel(), dtype=torch.bool, device=feats.device)] * i, 1)
        hidden, kv = drafter.step(step_ids[:, i, rows], hidden, pos[:, rows] + i, past, mask[None])
        alive = keep(i, rows, hidden)
        rows, hidden, causal = rows[alive], hidden[:, alive], causal[alive]
        # step 0's keys serve every row; later steps' only their own row, so they follow the rows still run
        past = [tuple(t[:, :, alive] for t in p) if j else p for j, p in enumerate([*past, kv])]
        if not rows.numel():
            return


def scored_unroll(drafter, feats: torch.Tensor, step_ids: torch.Tensor, pos: torch.Tensor, scored: torch.Tensor,
                  columns: tuple[torch.Tensor, torch.Tensor] | None = None,
                  choice: torch.Tensor | None = None) -> list[tuple[torch.Tensor, ...]]:
    """The unroll's logits where a loss reads them: (rows (n_i,), logits (1, n_i, Vd)) per step for `scored`
    (1, K, R) bool (supervised, the target's argmax a draft token). Step i >= 1 runs only the rows some step >= i
    scores and the LM head only the rows step i scores (`pruned`): a prompt's rows are step 0's keys and nothing
    more. The same loss and gradients as `unroll`'s logits (tests/test_eagle3_pruned.py); on the rehearsal's sequences
    (30% of their rows are prompt) a training step took ~17% less. `columns`: (draft ids, bias) the head scores, else
    all (`train.sampled_softmax`). `choice` (K, R): the target's choice in the head's columns; given, step i+1 runs
    only the rows whose step-i draft equals it, the rows decoding reaches (GRIFFIN's token-alignable training, arXiv
    2502.11018: a draft after a rejected one is never verified, so training it spends the step on nothing decoding
    uses); their logits are still exactly `unroll`'s."""
    K = step_ids.shape[1]
    if columns is None:
        head = drafter.logits
    else:
        rows_of_head = drafter.lm_head.weight[columns[0]]  # (C, D)

        def head(hidden):
            return F.linear(drafter.norm(hidden), rows_of_head) + columns[1].to(hidden.dtype)

    needed = scored[0].flip(0).cumsum(0).flip(0) > 0  # (K, R): some step >= i scores the row
    out: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep(i, rows, hidden):
        at = scored[0, i, rows]
        logits = head(hidden[:, at])
        out.append((rows[at], logits))
        if i + 1 == K:
            return torch.zeros_like(at)
        if choice is None:
            return needed[i + 1, rows]
        hit = torch.zeros_like(at)
        hit[at] = logits[0].detach().argmax(-1) == choice[i, rows[at]]
        return needed[i + 1, rows] & hit

    pruned(drafter, feats, step_ids, pos, keep)
    width = drafter.lm_head.out_features if columns is None else columns[0].numel()
    none = (torch.zeros(0, dtype=torch.int64, device=feats.device),
            feats.new_zeros(1, 0, width, dtype=drafter.lm_head.weight.dtype))
    return out + [none] * (K - len(out))


@torch.no_grad()
def leading(drafter, feats: torch.Tensor, step_ids: torch.Tensor, pos: torch.Tensor, choice: torch.Tensor,
            valid: torch.Tensor) -> torch.Tensor:
    """Teacher-forced accepted drafts per row: the unroll's leading run of steps whose argmax equals `choice`
    (B = 1; `unroll`'s inputs, and (1, K, R) the target's choice in draft ids and where it counts). Equal to
    counting over `unroll`'s logits, but step i >= 1 runs only the rows whose drafts all matched so far
    (`pruned`). A held-out measurement then costs about one step instead of K (SmolLM2: 5.2 s -> ~1 s each,
    ~35% of EAGLE-3's training time at 610 steps). Returns (rows valid at step 0,) int64."""
    counts = torch.zeros(feats.shape[1], dtype=torch.int64, device=feats.device)

    def keep(i, rows, hidden):
        alive = (drafter.logits(hidden)[0].argmax(-1) == choice[0, i, rows]) & valid[0, i, rows]
        counts[rows[alive]] += 1
        return alive

    pruned(drafter, feats, step_ids, pos, keep)
    return counts[valid[0, 0]]
