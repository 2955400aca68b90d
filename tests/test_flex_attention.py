"""Attention backends and sliding-window layers: flex equals sdpa, sliding masks are exact.

flex_attention runs here eagerly on CPU (forward only: torch has no CPU flex backward),
so these tests compare losses under no_grad; on CUDA the backend is compiled.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from draftflow.config import DrafterConfig
from draftflow.drafters.dflash.batches import make_block_batch
from draftflow.drafters.dflash.config import DFlashConfig
from draftflow.drafters.dflash.mask import block_attention_mask, sliding_window_mask
from draftflow.drafters.dflash.model import DFlashDrafter
from draftflow.drafters.dflash.objective import dflash_loss
from draftflow.errors import ConfigError
from draftflow.features import FeatureSample
from tests.conftest import MASK_ID, B


def make_drafter(target, **over):
    drafter = DrafterConfig(num_layers=2, block_size=B, num_taps=3, **over)
    dcfg = DFlashConfig.from_target(target.config, drafter, MASK_ID)
    torch.manual_seed(1)
    return DFlashDrafter(dcfg, target).eval()


def batch(T=30):
    g = torch.Generator().manual_seed(0)
    sample = FeatureSample("s", torch.randint(0, MASK_ID, (T,), generator=g), torch.ones(T, dtype=torch.bool),
                           torch.randn(T, 3, 64, generator=g))
    return make_block_batch(sample, torch.tensor([1, 4, 9, 17, 25]), B, MASK_ID)


def loss_of(drafter, b):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex warns that eager mode is unfused
        logits = drafter(b.block_ids, b.block_pos, b.ctx_hidden, b.ctx_pos, b.attn_mask)
    return logits, dflash_loss(logits, b.labels, B, 3.0).loss


@pytest.mark.parametrize("layers", [None, ["sliding_attention", "full_attention"]])
def test_flex_and_sdpa_give_the_same_loss(target, layers):
    over = {"layer_types": layers, "sliding_window": 6} if layers else {}
    sdpa, flex = make_drafter(target, attn_backend="sdpa", **over), make_drafter(target, attn_backend="flex", **over)
    b = batch()
    (l_sdpa, loss_sdpa), (l_flex, loss_flex) = loss_of(sdpa, b), loss_of(flex, b)
    torch.testing.assert_close(l_flex, l_sdpa, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(loss_flex, loss_sdpa, atol=1e-5, rtol=1e-5)


def test_auto_backend_is_sdpa_on_cpu(target):
    assert make_drafter(target).config.attn_backend == "auto"
    b = batch()
    auto, sdpa = loss_of(make_drafter(target), b)[1], loss_of(make_drafter(target, attn_backend="sdpa"), b)[1]
    torch.testing.assert_close(auto, sdpa)


def test_sliding_mask_exact_entries():
    anchors, C, W = torch.tensor([3, 9]), 12, 3
    full = block_attention_mask(anchors, B, C)
    q_pos = (anchors[:, None] + torch.arange(B)).reshape(-1)
    k_pos = torch.cat([torch.arange(C), q_pos])
    got = sliding_window_mask(full, q_pos, k_pos, W)
    want = torch.zeros_like(full)
    for q in range(len(q_pos)):
        j, p = q // B, int(q_pos[q])
        a = int(anchors[j])
        for c in range(C):  # context before the anchor and inside the window (p - c < W)
            want[q, c] = c < a and p - c < W
        for s in range(B):  # own block only, causal, and inside the window
            want[q, C + j * B + s] = s <= q % B and (q % B - s) < W
    assert torch.equal(got, want)
    assert got[0, :C].tolist() == [False, True, True] + [False] * 9  # slot 0 at p=3 sees 1, 2
    assert got[3, :C].sum() == 0 and got[3, C + 1 : C + 4].all()  # slot 3 (p=6): block slots 1..3


def test_all_full_layer_types_change_nothing(target):
    b = batch()
    plain = loss_of(make_drafter(target, attn_backend="sdpa"), b)[0]
    full = loss_of(make_drafter(target, attn_backend="sdpa", layer_types=["full_attention"] * 2), b)[0]
    sliding = loss_of(make_drafter(target, attn_backend="sdpa", layer_types=["sliding_attention"] * 2,
                                   sliding_window=6), b)[0]
    assert torch.equal(plain, full)
    assert not torch.allclose(plain, sliding)


@pytest.mark.parametrize("over", [
    {"layer_types": ["full_attention"]},
    {"layer_types": ["sliding_attention", "full_attention"]},
    {"layer_types": ["global", "full_attention"]},
])
def test_layer_type_errors_name_the_setting(target, over):
    with pytest.raises(ConfigError, match="drafter"):
        make_drafter(target, **over)
