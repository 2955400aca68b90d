"""The EAGLE-3 drafter (arXiv 2503.01840): fused taps, one decoder layer, training-time test.

Read top to bottom: the unroll mask, the decoder layer, then `Eagle3Drafter` (its config: `config.py`).

Shape (as served by vLLM's `llama_eagle3.py`, `Eagle3LlamaForCausalLM`, and trained by
vllm-project/speculators `models/eagle3/core.py`):
  * `fc` (3D -> D, no bias) fuses the target's low/mid/high taps (concatenated in tap order).
  * One Llama-style decoder layer (`midlayer`, no q/k norm) whose attention input is
    concat(input_layernorm(embed(token)), hidden_norm(hidden)): 2D wide, so q/k/v_proj
    take 2D inputs. The residual is the *hidden* stream (vLLM's `norm_before_residual=False`).
    The paper has that one layer; `drafter.num_layers` > 1 adds plain Llama layers after it
    (`later`, served by vLLM as `layers.1..`: its `LlamaDecoderLayer` reads 2D only at `layer_idx` 0).
  * `norm` then `lm_head` over the **draft vocabulary** (`draft_vocab_size` rows);
    draft id i is target id `i + d2t[i]`, and `t2d` marks the target ids in the draft
    vocabulary (both from the tokenize stage, kept as buffers and saved with the weights).
  * The target's embedding is shared and frozen. The target's LM head is also borrowed,
    frozen, only to turn its final normed hidden state into soft targets.

Alignment (the one rule every part of draftflow follows; speculators `eagle3/data.py`
`shift_batch` pairs `hidden_states[:-1]` with `input_ids[1:]` and the verifier's state
`[1:]`): for a sequence x_0..x_{T-1} with target taps h_p and final normed state f_p,
  * row t (t = 0..T-2) of unroll step 0 holds (h_t, embed(x_{t+1})) at RoPE position t and
    predicts x_{t+2}; its soft target is softmax(target_head(f_{t+1}))[t2d], the target's
    own distribution for x_{t+2};
  * step i >= 1 feeds back the layer's output hidden of step i-1 at the same row (pre-norm,
    as vLLM passes `hidden_prenorm` to the next draft), the token x_{t+1+i}, RoPE position
    t+i, and predicts x_{t+2+i} against softmax(target_head(f_{t+1+i}))[t2d];
  * a row of step i is supervised iff x_{t+2+i} exists and loss_mask[t+2+i] is set (the
    predicted token's own mask, as DFlash labels are; speculators uses the input token's
    mask, one position earlier) and the target's argmax at f_{t+1+i} is in the draft vocab.
At decoding that is exactly chain drafting: the target has read x_0..x_n and produced
x_{n+1}; the drafter's rows 0..n are (h_p, x_{p+1}) and draft j appends (g, x̂_{n+1+j}) at
position n+j, g being the previous draft's output hidden (`draft_chain`).

Unroll mask (`ttt_attention_mask`; speculators `eagle3/attention.py`,
`create_combined_mask_mod` + `extend_dense_mask_for_draft_tokens`): row t of step i sees
rows <= t of step 0 (the target-feature "cache") and exactly row t of steps 1..i. That is
what chain drafting from anchor t sees, so the unroll equals decoding
(tests/test_eagle3_model.py checks it against `draft_chain`).

Key trade-off: step i attends over (i+1)*T keys with one dense boolean mask through SDPA:
one definition of the rule, any device, at the cost of computing (and masking) the
off-diagonal entries of steps 1..i.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftflow.drafters.eagle3.config import Eagle3Config
from draftflow.drafters.eagle3.pruned import Scoring, read_positions, scored_rows, scored_unroll, with_exact
from draftflow.errors import ConfigError
from draftflow.models.attention import sdpa_attention
from draftflow.models.blocks import MLP, RMSNorm, apply_rope, rope_cos_sin
from draftflow.models.weights import SharedTargetDrafter, load_exact, read_weights_and_config

# Prefixes of the target's modules shared into the drafter: frozen, never saved.
SHARED_PREFIXES = ("embed_tokens.", "target_head.")


# ----------------------------------------------------------------------------- unroll mask


def ttt_attention_mask(n_rows: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Keys row t of unroll step `step` may see (True = attend); see the module docstring.

    Keys are laid out [step 0 rows 0..T-1, step 1 rows 0..T-1, ..., step `step` rows].

    Returns:
        (T, (step + 1) * T) bool.
    """
    row = torch.arange(n_rows, device=device)
    causal = row[:, None] >= row[None, :]  # step 0: the target-feature rows up to t
    same_row = row[:, None] == row[None, :]  # steps 1..i: only this row's own earlier drafts
    return torch.cat([causal] + [same_row] * step, dim=1)


# ----------------------------------------------------------------------------- the layer


class Eagle3Attention(nn.Module):
    """Llama GQA attention on `width`-wide inputs (2D in `midlayer`: [embedding, hidden]); keys/values of earlier
    unroll steps come in `past`."""

    def __init__(self, cfg: Eagle3Config, width: int):
        super().__init__()
        self.n_head, self.n_kv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.q_proj = nn.Linear(width, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(width, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(width, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, rope, past: list[tuple[torch.Tensor, torch.Tensor]], mask):
        """x (B, T, width); past: k/v (B, Hkv, T, hd) of earlier steps; mask (B, T, (len(past)+1)*T).

        Returns:
            (B, T, D) output and this step's (k, v).
        """
        B, T, _ = x.shape
        q = apply_rope(self.q_proj(x).view(B, T, self.n_head, self.hd).transpose(1, 2), *rope)
        k = apply_rope(self.k_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2), *rope)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)  # (B, Hkv, T, hd)
        keys = torch.cat([pk for pk, _ in past] + [k], dim=2)  # (B, Hkv, (i+1)*T, hd)
        values = torch.cat([pv for _, pv in past] + [v], dim=2)
        y = sdpa_attention(q, keys, values, mask, self.scale)  # (B, H, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.hd)), (k, v)


class Eagle3Layer(nn.Module):
    """The first decoder layer (`midlayer`, vLLM's and EAGLE-3's name for it; the paper's only one)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg, 2 * cfg.hidden_size)  # EAGLE-3: [embedding, hidden] concatenated
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, emb, hidden, rope, past, mask):
        # EAGLE-3: attention reads [input_layernorm(embedding), hidden_norm(hidden)] (embedding
        # first, as vLLM concatenates); the residual stream is the un-normed hidden.
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)  # (B, T, 2D)
        a, kv = self.self_attn(x, rope, past, mask)
        h = hidden + a
        return h + self.mlp(self.post_attention_layernorm(h)), kv


class LaterLayer(nn.Module):
    """A decoder layer after `midlayer` (`drafter.num_layers` > 1): a plain pre-norm Llama layer on the hidden
    stream, named as the target's so `train.init_from_target` copies one whole."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg, cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, hidden, rope, past, mask):
        a, kv = self.self_attn(self.input_layernorm(hidden), rope, past, mask)
        h = hidden + a
        return h + self.mlp(self.post_attention_layernorm(h)), kv


# ----------------------------------------------------------------------------- the drafter


class Eagle3Drafter(SharedTargetDrafter):
    """EAGLE-3 drafter sharing the target's frozen embedding (and, for soft targets, its LM head).

    Args:
        cfg: the drafter's shape.
        target_model: the HF causal LM whose embedding and LM head are borrowed (same modules).
        d2t: (draft_vocab_size,) int64, draft id i -> target id i + d2t[i]; None = zeros
            (to be loaded with the weights).
        t2d: (vocab_size,) bool, target ids in the draft vocabulary; None = the first ids.

    Raises:
        ConfigError: widths that disagree with the target, or d2t/t2d that disagree with each other.
    """

    shared_prefixes = SHARED_PREFIXES

    def __init__(self, cfg: Eagle3Config, target_model: nn.Module, d2t: torch.Tensor | None = None,
                 t2d: torch.Tensor | None = None):
        super().__init__()
        cfg.validate()
        self.config = cfg
        embed, head = target_model.get_input_embeddings(), target_model.get_output_embeddings()
        _check_shared(cfg, embed, head)
        self.embed_tokens = embed.requires_grad_(False)  # EAGLE-3: the target's, frozen, never saved
        self.target_head = head.requires_grad_(False)  # soft targets only; never saved
        D = cfg.hidden_size
        self.fc = nn.Linear(3 * D, D, bias=False)  # EAGLE-3: fuse low/mid/high taps
        self.midlayer = Eagle3Layer(cfg)
        self.later = nn.ModuleList(LaterLayer(cfg) for _ in range(cfg.num_layers - 1))
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(D, cfg.draft_vocab_size, bias=False)  # draft vocabulary only
        d2t, t2d = _vocab_maps(cfg, d2t, t2d)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        for module in [self.fc, *self.midlayer.modules(), *self.later.modules()]:
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)  # HF initializer_range
        with torch.no_grad():  # draftflow's choice: start the draft head at the target head's rows
            rows = self.draft_to_target(torch.arange(cfg.draft_vocab_size)).to(head.weight.device)
            self.lm_head.weight.copy_(head.weight[rows])

    @torch.no_grad()
    def init_beyond_names(self, sources: list[nn.Module]) -> list[str]:
        """What the target gives an EAGLE-3 layer beyond the tensors of matching name and shape (draftflow's choice):
        `fc` starts as the identity on the deepest tap (zero on the others), the hidden half of `midlayer`'s q/k/v as
        its target layer's q/k/v (`sources[0]`) and `hidden_norm` as its input norm, so the first drafts start as the
        target's layers applied to the deepest tap, not as noise (held out on SmolLM2 at 300 steps: tau 1.308 ->
        1.429, docs/results.md); `later` layers are copied whole by name.
        Skipped where the widths differ (a target wider than the drafter) or the layer is not Llama-shaped."""
        D, source, names = self.config.hidden_size, sources[0], ("q_proj", "k_proj", "v_proj")  # midlayer's
        mine = {n: getattr(self.midlayer.self_attn, n).weight for n in names}
        theirs = {n: getattr(getattr(source, "self_attn", None), n, None) for n in names}
        norm = getattr(source, "input_layernorm", None)
        if (norm is None or self.fc.in_features != 3 * D
                or any(t is None or t.weight.shape != (mine[n].shape[0], D) for n, t in theirs.items())):
            return []
        self.fc.weight.zero_()
        self.fc.weight[:, 2 * D:].copy_(torch.eye(D))  # taps are validated ascending: the last is the deepest
        for name in names:
            mine[name][:, D:].copy_(theirs[name].weight)  # [embedding half, hidden half]
        self.midlayer.hidden_norm.weight.copy_(norm.weight)
        return ["fc.weight (identity on the deepest tap)", *(f"0.self_attn.{n}.weight (hidden half)" for n in names),
                "0.hidden_norm.weight"]

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft ids (`i + d2t[i]`)."""
        d2t = self.d2t.to(draft_ids.device)
        return draft_ids + d2t[draft_ids]

    def decoder_layers(self) -> list[nn.Module]:
        return [self.midlayer, *self.later]

    def step(self, ids, hidden, pos, past, mask) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """One pass of the layers: ids (B, T) tokens, hidden (B, T, D) hidden stream, pos (B, T) RoPE positions,
        past: the keys/values of earlier steps (what this returned for them), mask (B, T, keys) -> (pre-norm hidden,
        keys/values (B, Hkv, T, hd) of every layer, flat: (k, v) of `midlayer`, then of each `later` layer)."""
        dtype = self.fc.weight.dtype
        emb = self.embed_tokens(ids).to(dtype)
        rope = rope_cos_sin(pos, self.config.head_dim, self.config.rope_theta, dtype)
        h, kv = self.midlayer(emb, hidden.to(dtype), rope, [p[:2] for p in past], mask)
        for j, layer in enumerate(self.later, start=1):
            h, more = layer(h, rope, [p[2 * j : 2 * j + 2] for p in past], mask)
            kv += more
        return h, kv

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of layer outputs."""
        return self.lm_head(self.norm(hidden))

    def unroll(self, feats: torch.Tensor, step_ids: torch.Tensor, pos: torch.Tensor) -> list[torch.Tensor]:
        """The training-time-test unroll: one logits tensor (B, T, Vd) per step.

        Args:
            feats: (B, T, 3D) target taps of rows 0..T-1 (concatenated in tap order).
            step_ids: (B, K, T) input token of every row at every step (see the module docstring).
            pos: (B, T) RoPE positions of step 0 (step i uses pos + i).
        """
        hidden = self.fc(feats.to(self.fc.weight.dtype))  # (B, T, D)
        past: list[tuple[torch.Tensor, ...]] = []  # each step's keys/values of every layer (`step`)
        out = []
        for i in range(step_ids.shape[1]):
            mask = ttt_attention_mask(feats.shape[1], i, feats.device)[None]
            hidden, kv = self.step(step_ids[:, i], hidden, pos + i, past, mask)
            past.append(kv)  # the unroll's "cache": step i's keys at every row
            out.append(self.logits(hidden))
        return out

    @torch.no_grad()
    def soft_targets(self, final_hidden: torch.Tensor,
                     in_vocab: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's distribution over the draft vocabulary, from its final normed hidden states.

        Args:
            in_vocab: what an earlier call returned for the same states: then only the draft vocabulary's rows of the
                target's head run (1/6 of it for SmolLM2's 8,192 of 49,152), the probabilities are the same.

        Returns:
            probs (..., Vd) fp32 summing to 1, and in_vocab (...) bool: the target's argmax
            (over its whole vocabulary) is a draft token; rows without it are not supervised.
        """
        x = final_hidden.to(self.target_head.weight.dtype)
        if in_vocab is None:
            in_vocab = self.t2d.to(x.device)[self.target_head(x).argmax(-1)]
        # always the draft rows alone, so the probabilities never depend on whether in_vocab was known
        rows = self.target_head.weight[self.t2d.to(x.device)]  # (Vd, D) in draft-id order (~1% of a step to copy)
        return F.softmax(F.linear(x, rows).float(), dim=-1), in_vocab

    @torch.no_grad()
    def soft_targets_at(self, final_hidden: torch.Tensor, read: torch.Tensor,
                        in_vocab: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`soft_targets` computed only where `read` (B, T') is True: the target's whole head is a quarter of an
        EAGLE-3 training step, and a prompt's positions are never scored. Elsewhere the distribution is uniform
        (finite, never scored) and in_vocab False, so a loss masked by in_vocab is exactly `soft_targets`'s.
        `in_vocab` (B, T'): an earlier call's for the same states (`soft_targets`)."""
        vd = self.lm_head.out_features  # the draft vocabulary
        probs = final_hidden.new_full((*read.shape, vd), 1.0 / vd, dtype=torch.float32)
        known = None if in_vocab is None else in_vocab[read]
        in_vocab = torch.zeros(read.shape, dtype=torch.bool, device=final_hidden.device)
        probs[read], in_vocab[read] = self.soft_targets(final_hidden[read], known)
        return probs, in_vocab

    def forward(self, feats, step_ids, pos, final_hidden, read: torch.Tensor | None = None,
                in_vocab: torch.Tensor | None = None, scoring: Scoring | None = None):
        """Training forward (one call, so a wrapped module sees it): unroll logits and soft targets (only at the
        positions `read`, (B, T') bool, when given: `soft_targets_at`; `in_vocab`: an earlier call's for the same
        sequence, with `read`).

        Returns:
            (logits, probs (B, T', Vd), in_vocab (B, T')) for `final_hidden` (B, T', D): logits a list of K
            (B, T, Vd), or with `scoring` `scored_unroll`'s (rows, logits) at the rows supervised whose target's
            argmax is a draft token. With `scoring.columns` (train.sampled_softmax) the head scores those draft ids
            and the target's argmax at every scored row, and probs holds the same columns.
        """
        if read is None:
            probs, in_vocab = self.soft_targets(final_hidden)
        else:
            probs, in_vocab = self.soft_targets_at(final_hidden, read, in_vocab)
        if scoring is None:
            return self.unroll(feats, step_ids, pos), probs, in_vocab
        scored, columns = scored_rows(scoring.supervised, in_vocab), scoring.columns
        choice = probs[0].argmax(-1)[read_positions(*scored.shape[1:], probs.shape[1], probs.device)]  # (K, R)
        if columns is not None:  # the target's argmax where scored: always exact, so a hit is still a hit
            columns = with_exact(*columns, choice[scored[0]])
            probs = probs[..., columns[0]]
            choice = torch.searchsorted(columns[0], choice)  # in the columns (where scored)
        unrolled = scored_unroll(self, feats, step_ids, pos, scored, columns, choice if scoring.reached else None)
        return unrolled, probs, in_vocab

    @classmethod
    def load(cls, in_dir: str | Path, target_model: nn.Module) -> Eagle3Drafter:
        """Rebuild a saved drafter around `target_model`'s embedding and head.

        Raises:
            StoreError: files missing, or weights that do not match the config exactly.
        """
        config, weights = read_weights_and_config(in_dir)
        return cls.from_weights(Eagle3Config.from_dict(config), weights, target_model, str(in_dir))

    @classmethod
    def from_weights(cls, cfg: Eagle3Config, weights: dict[str, torch.Tensor], target_model: nn.Module,
                     where: str) -> Eagle3Drafter:
        """A drafter holding exactly `weights` (draftflow names, d2t/t2d included)."""
        return load_exact(cls(cfg, target_model, weights.get("d2t"), weights.get("t2d")), weights, where)


@torch.no_grad()
def draft_chain(drafter: Eagle3Drafter, feats: torch.Tensor, next_ids: list[int], depth: int,
                forced: list[int] | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """Chain drafting without a KV cache: `depth` greedy drafts after the target's latest token.

    Args:
        feats: (n+1, 3D) target taps at positions 0..n (the tokens the target has read).
        next_ids: x_1..x_{n+1}: row p pairs h_p with x_{p+1}; x_{n+1} is the target's newest token.
        depth: drafts to make.
        forced: feed these tokens back instead of the drafts (teacher forcing, for tests).

    Returns:
        (draft tokens as target ids, the draft-vocabulary logits of each draft).
    """
    device = drafter.fc.weight.device
    ids = torch.tensor(next_ids, dtype=torch.long, device=device)
    hidden = drafter.fc(feats.to(device, drafter.fc.weight.dtype))  # (n+1, D)
    pos = torch.arange(len(next_ids), device=device)
    drafts: list[int] = []
    logits: list[torch.Tensor] = []
    for j in range(depth):
        mask = ttt_attention_mask(ids.numel(), 0, device)[None]  # plain causal over all rows
        h, _ = drafter.step(ids[None], hidden[None], pos[None], [], mask)
        out = drafter.logits(h[0, -1])  # the newest row predicts the next token
        token = int(drafter.draft_to_target(out.argmax()[None]))
        drafts.append(token)
        logits.append(out)
        fed = forced[j] if forced is not None else token
        # Draft j+1: this draft's output hidden with the fed token, one position further.
        ids = torch.cat([ids, ids.new_tensor([fed])])
        hidden = torch.cat([hidden, h[0, -1:]])
        pos = torch.cat([pos, pos[-1:] + 1])
    return drafts, logits


def _vocab_maps(cfg: Eagle3Config, d2t, t2d) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked d2t/t2d buffers: draft id i is the i-th target id marked in t2d."""
    n, V = cfg.draft_vocab_size, cfg.vocab_size
    d2t = torch.zeros(n, dtype=torch.int64) if d2t is None else d2t.to("cpu", torch.int64)
    t2d = (torch.arange(V) < n) if t2d is None else t2d.to("cpu", torch.bool)
    if d2t.shape != (n,) or t2d.shape != (V,):
        raise ConfigError(f"draft vocabulary maps have shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)}; the "
                          f"drafter needs ({n},) and ({V},): re-run tokenize with this target and draft_vocab_size")
    if not torch.equal(torch.arange(n) + d2t, t2d.nonzero().squeeze(1)):
        raise ConfigError("draft vocabulary maps disagree (i + d2t[i] must list the ids marked in t2d, "
                          "ascending); re-run the tokenize stage")
    return d2t, t2d


def _check_shared(cfg: Eagle3Config, embed: nn.Module, head: nn.Module | None) -> None:
    rows, width = embed.weight.shape
    if width != cfg.hidden_size or head is None or tuple(head.weight.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ConfigError(f"target embedding/LM head shapes {tuple(embed.weight.shape)} do not match the "
                          f"EAGLE-3 config (vocab {cfg.vocab_size}, hidden {cfg.hidden_size}); build the "
                          "Eagle3Config from this target's config")
    if rows < cfg.vocab_size:
        raise ConfigError(f"target embedding has {rows} rows, fewer than its vocab_size {cfg.vocab_size}")
