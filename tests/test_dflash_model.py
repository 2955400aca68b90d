"""DFlash drafter module: config, mask rule, attention, sharing with the target, save/load.

The mask tests come in pairs: the library's rule must pass a check, and the library's
rule with a known peer bug put back into its source (`<=` at the anchor, causal mask
inside a block, blocks seeing each other; see tests/mutants.py) must fail that same check.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from draftflow.compat import rope_theta
from draftflow.config import DrafterConfig
from draftflow.drafters.dflash.config import DFlashConfig
from draftflow.drafters.dflash.mask import block_attention_mask
from draftflow.drafters.dflash.model import DFlashDrafter
from draftflow.errors import ConfigError, StoreError
from draftflow.models.attention import ATTENTION_BACKENDS
from draftflow.models.blocks import rope_cos_sin
from tests.conftest import MASK_ID
from tests.mutants import mutant


@pytest.fixture(scope="module")
def dcfg(target):
    return DFlashConfig.from_target(target.config, DrafterConfig(num_layers=2, block_size=4, num_taps=3), MASK_ID)


@pytest.fixture(scope="module")
def drafter(target, dcfg):
    torch.manual_seed(1)
    return DFlashDrafter(dcfg, target).eval()


# ----------------------------------------------------------------------------- config


def test_config_from_target(target, dcfg):
    assert dcfg.target_layer_ids == [1, 2, 3]  # round(1 + i*(6-4)/2)
    assert (dcfg.hidden_size, dcfg.num_heads, dcfg.num_kv_heads, dcfg.head_dim) == (64, 4, 2, 16)
    assert dcfg.vocab_size == 320 and dcfg.mask_token_id == MASK_ID and dcfg.num_layers == 2
    assert DFlashConfig.from_dict(json.loads(json.dumps(dcfg.to_dict()))) == dcfg
    explicit = DrafterConfig(num_taps=2, target_layer_ids=[0, 4], mask_token_id=7)
    assert DFlashConfig.from_target(target.config, explicit, MASK_ID).mask_token_id == 7


@pytest.mark.parametrize(
    "bad",
    [
        dict(drafter=DrafterConfig(num_taps=3), mask=320),  # no embedding row
        dict(drafter=DrafterConfig(num_taps=3), mask=None),  # no mask id at all
        dict(drafter=DrafterConfig(num_taps=3, target_layer_ids=[1, 2]), mask=MASK_ID),
        dict(drafter=DrafterConfig(num_taps=2, target_layer_ids=[1, 6]), mask=MASK_ID),
    ],
)
def test_config_errors_name_the_setting(target, bad):
    with pytest.raises(ConfigError, match="drafter"):
        DFlashConfig.from_target(target.config, bad["drafter"], bad["mask"])


def test_config_rejects_unknown_keys_and_backends(dcfg):
    with pytest.raises(ConfigError, match="unknown keys"):
        DFlashConfig.from_dict(dcfg.to_dict() | {"surprise": 1})
    with pytest.raises(ConfigError, match="sdpa"):
        DFlashConfig.from_dict(dcfg.to_dict() | {"attn_backend": "nope"})


# ----------------------------------------------------------------------------- mask rule


def reference_mask(anchors: list[int], B: int, C: int) -> torch.Tensor:
    """The rule spelled out one entry at a time."""
    Q = len(anchors) * B
    m = torch.zeros(Q, C + Q, dtype=torch.bool)
    for q in range(Q):
        j = q // B
        for p in range(C):
            m[q, p] = p < anchors[j]  # strictly before the anchor
        for kq in range(Q):
            m[q, C + kq] = kq // B == j  # whole own block, no other block
    return m


# The known peer bugs, put back into the library's own `block_attention_mask` (tests/mutants.py).
MASK_BUGS = {
    "inclusive anchor": ("ctx_pos[None, :] < anchors", "ctx_pos[None, :] <= anchors"),  # `<=`
    "causal in block": (
        "sees_block = q_block[:, None] == q_block[None, :]",
        "sees_block = (q_block[:, None] == q_block[None, :]) & torch.ones(n_q, n_q, dtype=torch.bool,"
        " device=anchors.device).tril()",
    ),
    "blocks see each other": (
        "sees_block = q_block[:, None] == q_block[None, :]",
        "sees_block = torch.ones(n_q, n_q, dtype=torch.bool, device=anchors.device)",
    ),
}


def buggy_mask(bug: str):
    return mutant(block_attention_mask, *MASK_BUGS[bug])


def test_mask_exact_entries():
    anchors, B, C = [3, 7, 8], 4, 12
    got = block_attention_mask(torch.tensor(anchors), B, C)
    assert torch.equal(got, reference_mask(anchors, B, C))
    assert got[0, :3].all() and not got[0, 3:C].any()  # block 0 sees positions 0, 1, 2 only
    assert got[0, C : C + 4].all() and not got[0, C + 4 :].any()
    for bug in MASK_BUGS:  # the library's rule with each bug put back fails the same comparison
        assert not torch.equal(buggy_mask(bug)(torch.tensor(anchors), B, C), reference_mask(anchors, B, C)), bug


# ----------------------------------------------------------------------------- behaviour through the model


def run_blocks(drafter, anchors, tokens, ctx, mask_fn=block_attention_mask):
    """Logits (Q, V) for blocks at `anchors` over a sequence with features `ctx` (C, nD)."""
    B, C = drafter.config.block_size, ctx.shape[0]
    a = torch.tensor(anchors)
    pos = (a[:, None] + torch.arange(B)).reshape(1, -1)
    ids = torch.full_like(pos, MASK_ID)
    ids.view(len(anchors), B)[:, 0] = torch.tensor([tokens[i] for i in anchors])
    with torch.no_grad():
        return drafter(ids, pos, ctx[None], torch.arange(C)[None], mask_fn(a, B, C)[None])[0], ids


def probe(drafter, mask_fn) -> dict[str, bool]:
    """Which information flows each mask lets through (True = that leak exists)."""
    torch.manual_seed(3)
    B, C = drafter.config.block_size, 14
    tokens = torch.randint(0, MASK_ID, (C,)).tolist()
    ctx = torch.randn(C, 3 * 64)
    anchors = [5, 9]
    base, ids = run_blocks(drafter, anchors, tokens, ctx, mask_fn)

    def changed(out, rows):
        return not torch.allclose(out[rows], base[rows], atol=1e-6)

    leak_ctx = ctx.clone()
    leak_ctx[anchors[0]] += 5.0  # the feature AT block 0's anchor
    anchor_leak = changed(run_blocks(drafter, anchors, tokens, leak_ctx, mask_fn)[0], slice(0, B))
    # Block 1's anchor token changes; block 0 must not notice.
    other = list(tokens)
    other[anchors[1]] = (other[anchors[1]] + 1) % MASK_ID
    cross_leak = changed(run_blocks(drafter, anchors, other, ctx, mask_fn)[0], slice(0, B))
    # A later slot's token changes; an earlier slot must notice (bidirectional block).
    ids2 = ids.clone()
    ids2[0, B - 1] = 17
    C_pos = torch.arange(C)[None]
    pos = (torch.tensor(anchors)[:, None] + torch.arange(B)).reshape(1, -1)
    with torch.no_grad():
        out2 = drafter(ids2, pos, ctx[None], C_pos, mask_fn(torch.tensor(anchors), B, C)[None])[0]
    return {"anchor": anchor_leak, "cross": cross_leak, "bidirectional": changed(out2, slice(1, 2))}


def test_model_sees_only_what_the_rule_allows(drafter):
    ctx = torch.randn(14, 3 * 64)
    before_anchor = ctx.clone()
    before_anchor[4] += 5.0  # position a-1 must matter
    tokens = list(range(14))
    assert not torch.allclose(
        run_blocks(drafter, [5], tokens, ctx)[0], run_blocks(drafter, [5], tokens, before_anchor)[0]
    )
    assert probe(drafter, block_attention_mask) == {"anchor": False, "cross": False, "bidirectional": True}


@pytest.mark.parametrize(
    "bug, flag, value",
    [
        ("inclusive anchor", "anchor", True),
        ("causal in block", "bidirectional", False),
        ("blocks see each other", "cross", True),
    ],
)
def test_probe_catches_each_known_mask_bug(drafter, bug, flag, value):
    assert probe(drafter, buggy_mask(bug))[flag] is value


# ----------------------------------------------------------------------------- numerics


def test_rope_matches_transformers(target):
    pos = torch.tensor([[0, 3, 17, 250]])
    cos, sin = rope_cos_sin(pos, 16, rope_theta(target.config), torch.float32)
    hf_cos, hf_sin = Qwen3RotaryEmbedding(target.config)(torch.zeros(1, 4, 64), pos)
    torch.testing.assert_close(cos[:, 0], hf_cos)
    torch.testing.assert_close(sin[:, 0], hf_sin)


def test_sdpa_backend_matches_explicit_softmax():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    mask = torch.rand(2, 5, 9) > 0.4
    mask[..., 0] = True
    out = ATTENTION_BACKENDS["sdpa"](q, k, v, mask, 0.25)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # GQA: head h uses kv h//2
    scores = (q @ kk.transpose(-1, -2) * 0.25).masked_fill(~mask[:, None], float("-inf"))
    torch.testing.assert_close(out, scores.softmax(-1) @ vv)


def test_forward_shapes(drafter):
    logits, _ = run_blocks(drafter, [2, 6, 7], list(range(12)), torch.randn(12, 192))
    assert logits.shape == (12, 320)  # queries are block slots only, never context


# ----------------------------------------------------------------------------- sharing with the target


def test_constructing_a_drafter_leaves_the_target_untouched(target, dcfg):
    before = {k: v.clone() for k, v in target.state_dict().items()}
    torch.manual_seed(5)
    DFlashDrafter(dcfg, target)
    after = target.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_embedding_and_head_are_shared_frozen_and_not_counted(target, drafter):
    assert drafter.embed_tokens is target.get_input_embeddings()
    assert drafter.lm_head is target.get_output_embeddings()
    assert not drafter.embed_tokens.weight.requires_grad and not drafter.lm_head.weight.requires_grad
    trainable, frozen = drafter.param_counts()
    assert frozen == 2 * 320 * 64
    assert trainable == sum(v.numel() for v in drafter.trainable_state_dict().values())
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in drafter.trainable_state_dict())
    logits, _ = run_blocks(drafter, [3], list(range(8)), torch.randn(8, 192))
    drafter.zero_grad()
    with torch.enable_grad():
        ids = torch.full((1, 4), MASK_ID)
        out = drafter(
            ids,
            torch.arange(3, 7)[None],
            torch.randn(1, 8, 192),
            torch.arange(8)[None],
            block_attention_mask(torch.tensor([3]), 4, 8)[None],
        )
        out.sum().backward()
    assert drafter.lm_head.weight.grad is None and drafter.embed_tokens.weight.grad is None
    assert drafter.fc.weight.grad is not None


def test_mask_id_must_have_an_embedding_row(target, dcfg):
    cfg = DFlashConfig.from_dict(dcfg.to_dict() | {"vocab_size": 400, "mask_token_id": 350})
    with pytest.raises(ConfigError, match="only 320 rows"):
        DFlashDrafter(cfg, target)


# ----------------------------------------------------------------------------- save / load


def test_save_load_roundtrip(tmp_path, target, drafter):
    drafter.save(tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert set(weights) == set(drafter.trainable_state_dict())
    assert "layers.0.self_attn.q_proj.weight" in weights and "fc.weight" in weights  # HF-style names
    loaded = DFlashDrafter.load(tmp_path, target).eval()
    ctx = torch.randn(10, 192)
    torch.testing.assert_close(
        run_blocks(loaded, [4], list(range(10)), ctx)[0],
        run_blocks(drafter, [4], list(range(10)), ctx)[0],
        rtol=0,
        atol=0,
    )


def test_load_refuses_mismatched_weights(tmp_path, target, drafter):
    drafter.save(tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["norm.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(StoreError, match="norm.weight"):
        DFlashDrafter.load(tmp_path, target)
    with pytest.raises(StoreError, match="train a drafter first"):
        DFlashDrafter.load(tmp_path / "missing", target)
