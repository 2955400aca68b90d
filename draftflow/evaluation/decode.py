"""Speculative decoding with a DFlash or EAGLE-3 drafter, acceptance statistics and a lossless check.

Acceptance is measured by actually decoding (DFlash paper, arXiv 2602.06036:
mean acceptance length tau), not by training accuracy, which is known to
overstate served acceptance. Each step: the drafter fills the block
[anchor, mask x (B-1)] in one forward pass from the target's tap features at
all positions before the anchor; the target verifies the block; the longest
prefix of drafts equal to the target's greedy tokens is accepted, plus the
target's own next token (the bonus, which becomes the next anchor). An EAGLE-3 drafter
instead drafts a chain of `ttt_steps` tokens one after the other (`draftflow.drafters.eagle3.model.
draft_chain`, also without a KV cache); verification and acceptance are the same.

What it does not know: prompts' origin (token id lists), reports or plots,
sampling (greedy only, temperature 0).

Key trade-off: the target is re-run over the whole sequence every step (no KV
cache). That is O(T^2) per step and slow, but every target call is the same
plain forward pass that `greedy_generate` uses, so the lossless comparison is
exact and the code is short. It stays as the reference; the KV-cached loops
(`draftflow.evaluation.cached`, the default through `evaluate.kv_cache`) must equal it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from draftflow import progress
from draftflow.config import EvaluateConfig
from draftflow.drafters.registry import spec_for_architecture
from draftflow.errors import LosslessError
from draftflow.evaluation.baselines import Baseline
from draftflow.layers import hf_hidden_state_index
from draftflow.training import threads

logger = logging.getLogger(__name__)
RoundFn = Callable[[torch.Tensor], torch.Tensor]


@torch.no_grad()
def capture_taps(target, ids: list[int], layer_ids: list[int],
                 round_features: RoundFn | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One plain target forward: logits and tap features for every position.

    Args:
        target: HF causal LM.
        ids: the full token sequence.
        layer_ids: DFlash layer ids; id L is the output of decoder layer L,
            i.e. HF `hidden_states[L + 1]` (`draftflow.layers`).
        round_features: rounds (T, n_taps * D) features through the feature store's format
            (bf16, fp8 with scales, …) so the drafter sees at inference what it saw in training.

    Returns:
        logits (T, V) and features (T, n_taps * D), taps concatenated in `layer_ids` order
        (the same layout as a feature shard's (T, n_taps, D) reshaped).
    """
    device = target.get_input_embeddings().weight.device
    x = torch.tensor([ids], dtype=torch.long, device=device)
    out = target(input_ids=x, output_hidden_states=True, use_cache=False)
    feats = torch.cat([out.hidden_states[hf_hidden_state_index(lid)] for lid in layer_ids], dim=-1)[0]
    if round_features is not None:
        feats = round_features(feats)
    return out.logits[0], feats


def propose(drafter, seq: list[int], anchor: int, ctx: torch.Tensor) -> list[int]:
    """Greedy drafts for positions len(seq)+1 onwards, by the drafter kind's proposer (`DrafterSpec.propose`).

    Args:
        seq: the tokens the target has read (positions 0..n-1); anchor: its newest token (position n).
        ctx: (n, n_taps * D) tap features of positions 0..n-1.
    """
    if isinstance(drafter, Baseline):  # training-free proposers draft by themselves
        return drafter.propose(seq, anchor, ctx)
    return spec_for_architecture(drafter.config.architecture).propose(drafter, seq, anchor, ctx)


def drafts_per_step(drafter) -> int:
    """Most drafts one step can accept: B-1 (DFlash) or the chain depth (EAGLE-3)."""
    if isinstance(drafter, Baseline):
        return drafter.max_drafts
    return spec_for_architecture(drafter.config.architecture).drafts_per_step(drafter.config)


def _accept(drafts: list[int], target_next: list[int]) -> int:
    """Number of leading drafts equal to the target's greedy tokens at the same positions."""
    n = 0
    while n < len(drafts) and drafts[n] == target_next[n]:
        n += 1
    return n


def _finish(tokens: list[int], max_new_tokens: int, eos_ids: set[int]) -> tuple[list[int], bool]:
    """Cut after the first eos and at max_new_tokens; return (tokens, done)."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[: min(i + 1, max_new_tokens)], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


def speculative_generate(
    target, drafter: nn.Module, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int],
    round_features: RoundFn | None = None,
) -> tuple[list[int], list[int]]:
    """Greedy speculative decoding; output equals `greedy_generate` (lossless).

    Args:
        target: HF causal LM. drafter: a DFlash or EAGLE-3 drafter for that target.
        prompt_ids: prompt token ids (non-empty).
        max_new_tokens: exact cap on generated tokens.
        eos_ids: generation stops after the first of these (it is kept).
        round_features: the feature store's rounding (see `capture_taps`).

    Returns:
        (generated tokens, acceptance length per drafting step). A step's length is
        accepted drafts + 1 (the target's bonus token), counting only tokens kept, so
        `1 + sum(accept_lengths) == len(tokens)` (the first token comes from prefill).
    """
    layer_ids = drafter.config.target_layer_ids
    logits, feats = capture_taps(target, prompt_ids, layer_ids, round_features)
    seq = list(prompt_ids)  # tokens the target has read; the anchor sits at position len(seq)
    out, done = _finish([int(logits[-1].argmax())], max_new_tokens, eos_ids)
    accept: list[int] = []
    while not done:
        anchor, n = out[-1], len(seq)
        drafts = propose(drafter, seq, anchor, feats[:n])
        logits, feats = capture_taps(target, seq + [anchor] + drafts, layer_ids, round_features)
        target_next = logits[n:].argmax(-1).tolist()  # greedy tokens for positions n+1..n+B
        k = _accept(drafts, target_next)
        step_tokens = drafts[:k] + [target_next[k]]
        seq += [anchor] + drafts[:k]
        kept, done = _finish(out + step_tokens, max_new_tokens, eos_ids)
        accept.append(len(kept) - len(out))
        out = kept
        # Features of positions <= n+k were computed from accepted tokens only (causal
        # target), so they are exact context for the next block; later ones are dropped.
        feats = feats[: len(seq)]
    return out, accept


def greedy_generate(target, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """Reference greedy decoding by full recompute (the same forward as verification).

    Returns:
        Generated tokens, up to and including the first eos, at most `max_new_tokens`.
    """
    seq, out = list(prompt_ids), []
    while len(out) < max_new_tokens:
        logits, _ = capture_taps(target, seq, [0])
        token = int(logits[-1].argmax())
        out.append(token)
        seq.append(token)
        if token in eos_ids:
            break
    return out


def evaluate_prompts(
    target,
    drafter: nn.Module,
    prompts: list[list[int]],
    ecfg: EvaluateConfig,
    eos_ids: set[int],
    round_features: RoundFn | None = None,
    generate: Callable[..., tuple[list[int], list[int]]] | None = None,
    reference: Callable[..., list[int]] | None = None,
) -> dict:
    """Decode every prompt speculatively, check it against greedy, report acceptance.

    This runs the loops it is given, by default the uncached reference ones here;
    `draftflow.evaluation.cached.evaluate_prompts` chooses them by `ecfg.kv_cache`.

    Args:
        prompts: token id lists; the first `ecfg.num_prompts` are used (all when null).
        ecfg: the `evaluate` config section (`max_new_tokens`, `num_prompts`; `device` is the
            caller's: both models must already sit where they should run).
        eos_ids: token ids that end generation.
        round_features: the feature store's rounding (see `capture_taps`).
        generate: the speculative loop (the signature of `speculative_generate`, its default).
        reference: greedy's output to check the speculative one against, called as
            `reference(target, prompt, spec, max_new_tokens, eos_ids)`; by default `greedy_generate`'s
            (which ignores `spec`); the cached path reads it off one forward (`cached.greedy_along`).

    Returns:
        tau (mean acceptance length over all steps), acceptance_rate (per k=1..B-1,
        fraction of steps that accepted at least k drafts), accept_histogram, tokens,
        steps, prompts, tau_per_prompt (None where a prompt needed no drafting step), and
        outputs (the generated tokens per prompt, equal to greedy; not for reports) and
        accept_lengths (each prompt's acceptance length per step, for per-category stats; not for reports).

    Raises:
        LosslessError: speculative output differs from greedy (prompt index and position).
    """
    chosen = prompts[: ecfg.num_prompts] if ecfg.num_prompts else prompts
    lengths: list[int] = []
    outputs, per_prompt, per_step = [], [], []
    drafter.eval()
    generate, reference = generate or speculative_generate, reference or _greedy_reference
    chooser = threads.chooser_for(next(target.parameters()).device)  # CPU: the thread count, measured per prompt
    for i, prompt in enumerate(chosen):
        with threads.step(chooser) as work:  # later phases (baselines, DDTree) keep the count it chose
            spec, acc = generate(target, drafter, prompt, ecfg.max_new_tokens, eos_ids, round_features)
            ref = reference(target, prompt, spec, ecfg.max_new_tokens, eos_ids)
            work.units = len(prompt) + len(spec)
        check_lossless(i, spec, ref)
        lengths += acc
        outputs.append(spec)
        per_prompt.append(sum(acc) / len(acc) if acc else None)
        per_step.append(acc)
        progress.within("evaluate", i + 1, len(chosen), "prompts")
    return acceptance_stats(lengths, drafts_per_step(drafter) + 1) | {
        "tokens": sum(len(o) for o in outputs),
        "prompts": len(chosen),
        "tau_per_prompt": per_prompt,
        "outputs": outputs,
        "accept_lengths": per_step,
    }


def _greedy_reference(target, prompt_ids: list[int], spec: list[int], max_new_tokens: int,
                      eos_ids: set[int]) -> list[int]:
    """`evaluate_prompts`' default reference: a whole greedy decode (`spec` unused)."""
    return greedy_generate(target, prompt_ids, max_new_tokens, eos_ids)


def check_lossless(index: int, spec: list[int], ref: list[int]) -> None:
    """Raise LosslessError naming the prompt and first differing position."""
    if spec == ref:
        return
    pos = next((j for j, (a, b) in enumerate(zip(spec, ref, strict=False)) if a != b), min(len(spec), len(ref)))
    a = spec[pos] if pos < len(spec) else "<end>"
    b = ref[pos] if pos < len(ref) else "<end>"
    raise LosslessError(
        f"prompt {index}: speculative output differs from greedy at generated position {pos} "
        f"(speculative {a}, greedy {b}); the verifier or acceptance rule is wrong"
    )


def acceptance_stats(lengths: list[int], block_size: int) -> dict:
    """tau, per-position acceptance rates and a histogram from per-step acceptance lengths."""
    steps = len(lengths)
    lt = torch.tensor(lengths, dtype=torch.long)
    rate = [float((lt - 1 >= k).float().mean()) if steps else 0.0 for k in range(1, block_size)]
    hist = torch.bincount(lt, minlength=block_size + 1).tolist() if steps else [0] * (block_size + 1)
    return {
        "tau": float(lt.float().mean()) if steps else None,
        "acceptance_rate": rate,
        "accept_histogram": hist,
        "steps": steps,
    }
