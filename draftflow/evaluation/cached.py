"""KV-cached speculative decoding and greedy reference: the same tokens as `decode`, O(T) instead of O(T^2).

The uncached loops in `draftflow.evaluation.decode` re-run the whole target over the whole
sequence every step. Here the target keeps its KV cache (a transformers `DynamicCache`) across
verify steps: each step feeds only [anchor, drafts], reads logits and tap features of those
positions only, and crops the cache back past the rejected drafts. The drafter keeps its own
cache through its kind's `DrafterSpec.cached_proposer` (DFlash: the projected context K/V of
every layer; EAGLE-3: the target rows' K/V), to which only accepted positions' features are
appended. The acceptance rule and the output cut are decode's own (`_accept`, `_finish`), so
both loops accept by one rule, and `evaluate_prompts` here is the entry that honours
`evaluate.kv_cache`. Its lossless check reads greedy's tokens off one forward over the prompt and the
speculative output (`greedy_along`) instead of decoding greedily again.

What it does not know: drafter internals (the spec's proposer), reports, sampling (greedy only).

Key trade-off: a cached forward is the same computation as the full one but in other chunks,
so logits and features agree only up to float rounding, not bit for bit; greedy tokens (and so
τ) agree unless two logits tie within that rounding. Tests check token and per-step equality with
the uncached loops on float32 models; the lossless check compares cached speculative decoding with
greedy's argmaxes from one uncached forward, which agree with a cached greedy decode up to the same
rounding (a test compares them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from draftflow.compat import importing_transformers
from draftflow.config import EvaluateConfig
from draftflow.drafters.registry import spec_for_architecture
from draftflow.drafters.spec import CachedProposer
from draftflow.evaluation import decode
from draftflow.evaluation.baselines import Baseline
from draftflow.layers import hf_hidden_state_index

if TYPE_CHECKING:
    with importing_transformers():
        from transformers import DynamicCache  # imported when a cache is made: transformers is ~1.5 s of a run's start


@torch.no_grad()
def read_tokens(
    target, cache: DynamicCache, ids: list[int], layer_ids: list[int], round_features: decode.RoundFn | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Feed `ids` after the positions already in `cache`; logits and tap features of those positions only.

    Args:
        cache: the target's cache, extended in place by len(ids) positions.
        layer_ids: DFlash layer ids (`draftflow.layers`: id L is HF `hidden_states[L + 1]`,
            which with a cache holds the new positions only); empty = no features.
        round_features: the feature store's rounding, per row (see `decode.capture_taps`).

    Returns:
        logits (len(ids), V) and features (len(ids), n_taps * D), or None without layer ids.
    """
    device = target.get_input_embeddings().weight.device
    x = torch.tensor([ids], dtype=torch.long, device=device)
    out = target(input_ids=x, past_key_values=cache, use_cache=True, output_hidden_states=bool(layer_ids))
    if not layer_ids:
        return out.logits[0], None
    feats = torch.cat([out.hidden_states[hf_hidden_state_index(lid)] for lid in layer_ids], dim=-1)[0]
    if round_features is not None:
        feats = round_features(feats)
    return out.logits[0], feats


def new_cache() -> DynamicCache:
    """A target cache whose every layer keeps all positions (so any rollback is a crop, sliding layers too)."""
    with importing_transformers():
        from transformers import DynamicCache

    return DynamicCache()


def propose_cached(proposer: CachedProposer, seq: list[int], anchor: int, new_feats: torch.Tensor) -> list[int]:
    """The drafts of one step (a module-level call, so a test or kill point can intercept it)."""
    return proposer.propose(seq, anchor, new_feats)


def speculative_generate_cached(
    target,
    drafter,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_ids: set[int],
    round_features: decode.RoundFn | None = None,
) -> tuple[list[int], list[int]]:
    """`decode.speculative_generate` with the target's and the drafter's KV caches; same tokens, same steps.

    Args and Returns: as `decode.speculative_generate`.
    """
    layer_ids = drafter.config.target_layer_ids
    # A baseline (draftflow.evaluation.baselines) keeps no drafting state: it is its own proposer.
    proposer = (
        drafter
        if isinstance(drafter, Baseline)
        else spec_for_architecture(drafter.config.architecture).cached_proposer(drafter)
    )
    cache = new_cache()
    logits, new_feats = read_tokens(target, cache, list(prompt_ids), layer_ids, round_features)
    seq = list(prompt_ids)  # tokens the target has read (= positions in its cache after a step)
    out, done = decode._finish([int(logits[-1].argmax())], max_new_tokens, eos_ids)
    accept: list[int] = []
    while not done:
        anchor = out[-1]
        drafts = propose_cached(proposer, seq, anchor, new_feats)
        logits, feats = read_tokens(target, cache, [anchor] + drafts, layer_ids, round_features)
        target_next = logits.argmax(-1).tolist()  # greedy tokens for positions n+1..n+len(drafts)+1
        k = decode._accept(drafts, target_next)
        seq += [anchor] + drafts[:k]
        if k < len(drafts):
            cache.crop(-(len(drafts) - k))  # roll back the rejected drafts' keys/values
        # Features of the anchor and the accepted drafts were computed from accepted tokens only
        # (causal target): exact context for the next block. The rest belong to rejected drafts.
        new_feats = feats[: k + 1]
        kept, done = decode._finish(out + drafts[:k] + [target_next[k]], max_new_tokens, eos_ids)
        accept.append(len(kept) - len(out))
        out = kept
    return out, accept


def greedy_generate_cached(target, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """`decode.greedy_generate` with a KV cache: one token per forward after the prompt's prefill."""
    cache, ids, out = new_cache(), list(prompt_ids), []
    while len(out) < max_new_tokens:
        logits, _ = read_tokens(target, cache, ids, [])
        token = int(logits[-1].argmax())
        out.append(token)
        ids = [token]
        if token in eos_ids:
            break
    return out


@torch.no_grad()
def greedy_along(target, prompt_ids: list[int], spec: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """Greedy decoding's output as far as `spec` (a claimed greedy output) can show it, from one forward.

    Greedy decoding is defined token by token: each generated token is the target's argmax after the prompt
    and the tokens before it, up to and including the first end id, at most `max_new_tokens`. One plain
    forward over prompt + spec gives every one of those argmaxes at once (a causal target: position j sees
    only what precedes it), so checking a speculative output costs one prefill instead of a greedy decode
    of one forward per token (96 on SmolLM2: ~5.6 s a prompt on 2 CPU cores, against ~0.2 s).

    Returns:
        `spec` itself when it is greedy's output; otherwise greedy's output up to and including the first
        token where it departs from `spec` (a different token, an end `spec` went past, or a token after
        `spec` ended early), so `decode.check_lossless` names that position.
    """
    spec = list(spec[: max_new_tokens + 1])  # a spec longer than allowed differs from greedy right after the cap
    device = target.get_input_embeddings().weight.device
    x = torch.tensor([list(prompt_ids) + spec], dtype=torch.long, device=device)
    logits = target(input_ids=x, use_cache=False, logits_to_keep=len(spec) + 1).logits[0]
    greedy = logits.argmax(-1).tolist()  # greedy[j]: the argmax after prompt + spec[:j]
    out: list[int] = []
    for j, token in enumerate(greedy):
        if len(out) == max_new_tokens or (out and out[-1] in eos_ids):
            break  # greedy has ended here
        out.append(token)
        if j >= len(spec) or token != spec[j]:
            break  # the first departure: greedy's own token there
    return out


def evaluate_prompts(
    target,
    drafter,
    prompts: list[list[int]],
    ecfg: EvaluateConfig,
    eos_ids: set[int],
    round_features: decode.RoundFn | None = None,
) -> dict:
    """`decode.evaluate_prompts` with the loops `ecfg.kv_cache` chooses: cached (default) or the uncached reference.

    Args, Returns and Raises: as `decode.evaluate_prompts`.
    """
    if not ecfg.kv_cache:
        return decode.evaluate_prompts(target, drafter, prompts, ecfg, eos_ids, round_features)
    return decode.evaluate_prompts(
        target,
        drafter,
        prompts,
        ecfg,
        eos_ids,
        round_features,
        generate=speculative_generate_cached,
        reference=greedy_along,
    )
