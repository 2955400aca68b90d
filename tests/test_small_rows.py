"""SmallRowsLinear: the plain layer's outputs (to rounding) and gradients at every row count, the same state dict,
and every target loaded on the CPU has it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from draftflow.small_rows import FEW_ROWS, MIN_WEIGHT, SmallRowsLinear, use_small_rows


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 16), (2, 16), (3, 16), (1, 5, 16), (2, 3, 16), (7, 16), (8, 16), (2, 9, 16)])
def test_outputs_and_gradients_equal_the_plain_layer(shape, bias):
    torch.manual_seed(0)
    plain = nn.Linear(16, 40, bias=bias)
    fast = use_small_rows(nn.Linear(16, 40, bias=bias), min_weight=0)
    fast.load_state_dict(plain.state_dict())
    x = torch.randn(*shape, requires_grad=True)
    y_plain, y_fast = plain(x), fast(x)
    assert y_fast.shape == y_plain.shape == (*shape[:-1], 40)
    torch.testing.assert_close(y_fast, y_plain, rtol=1e-5, atol=1e-5)
    g_plain = torch.autograd.grad(y_plain.square().sum(), [x, plain.weight])
    g_fast = torch.autograd.grad(y_fast.square().sum(), [x, fast.weight])
    for a, b in zip(g_fast, g_plain):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_few_rows_take_the_transposed_product(monkeypatch):
    """2-7 rows go through `W @ x.T` and never through F.linear; 1 and 8 rows keep F.linear."""
    calls = []
    real = nn.functional.linear
    monkeypatch.setattr(nn.functional, "linear", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    layer = use_small_rows(nn.Linear(8, 4), min_weight=0)
    for rows in (1, 2, 7, 8):
        calls.clear()
        layer(torch.randn(rows, 8))
        assert bool(calls) == (rows not in FEW_ROWS), rows


def test_swap_keeps_state_dict_and_leaves_subclasses_alone():
    class Custom(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), Custom(4, 4), nn.Sequential(nn.Linear(4, 2)), nn.Linear(2, 2))
    keys = list(model.state_dict())
    assert use_small_rows(use_small_rows(model, min_weight=8), min_weight=8) is model  # idempotent
    assert [type(m) for m in model.modules()][1:] == [SmallRowsLinear, Custom, nn.Sequential, SmallRowsLinear,
                                                      nn.Linear]  # the last one's 4 weights stay below 8
    assert list(model.state_dict()) == keys


def test_cpu_targets_load_with_their_large_layers_swapped(tiny_target, tmp_path):
    """The tiny target's 64-wide layers stay plain (below MIN_WEIGHT); a copy with a 4,096-token head swaps the head."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from draftflow.target import load_target

    model, _ = load_target(tiny_target.path, "float32", "cpu")
    assert not any(type(m) is SmallRowsLinear for m in model.modules())
    config = AutoConfig.from_pretrained(tiny_target.path)
    config.vocab_size, config.tie_word_embeddings = 4096, False
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    for f in Path(tiny_target.path).glob("*token*"):
        shutil.copy(f, tmp_path / f.name)
    big, _ = load_target(str(tmp_path), "float32", "cpu")
    assert big.lm_head.weight.numel() >= MIN_WEIGHT and type(big.lm_head) is SmallRowsLinear
    assert all(type(m) is nn.Linear for m in big.model.layers.modules() if isinstance(m, nn.Linear))
