"""The tiny EAGLE-3 setup the EAGLE-3 tests share: a 6-layer target's greedy answers as features, the draft
vocabulary tokenize would build from them, a drafter around the target, a training config."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from draftflow.config import DrafterConfig, TrainConfig
from draftflow.drafters.eagle3.config import Eagle3Config
from draftflow.drafters.eagle3.model import Eagle3Drafter
from draftflow.drafters.eagle3.vocab import draft_vocab
from draftflow.engines.capture import HFCapture
from draftflow.features import FeatureSample
from draftflow.layers import FINAL

TAPS = [1, 2, 3]  # the 6-layer test target is too shallow for the default taps
K = 3  # unroll steps
VD = 200  # draft vocabulary (of 320)


@pytest.fixture(scope="module")
def samples(target):
    """Random prompts continued by the target's own greedy answers; features = 3 taps + FINAL."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 300, (8, 5), generator=g)
    out = target.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=19,
                          min_new_tokens=19, pad_token_id=0)
    feats = HFCapture(target, [*TAPS, FINAL]).capture(out.tolist())
    mask = torch.tensor([0] * 5 + [1] * 19, dtype=torch.bool)
    return [FeatureSample(f"s{i}", ids, mask, f) for i, (ids, f) in enumerate(zip(out, feats))]


@pytest.fixture(scope="module")
def vocab(samples):
    """d2t/t2d as the tokenize stage builds them from supervised-token counts."""
    freq = Counter(t for s in samples for t, m in zip(s.input_ids.tolist(), s.loss_mask.tolist()) if m)
    d2t, t2d = draft_vocab(freq, 320, VD)
    return torch.tensor(d2t), torch.tensor(t2d)


@pytest.fixture(scope="module")
def ecfg(target):
    return Eagle3Config.from_target(target.config, DrafterConfig(kind="eagle3", target_layer_ids=TAPS, ttt_steps=K), VD)


@pytest.fixture(scope="module", params=[1, 2], ids=["1 layer", "2 layers"])
def drafter(request, ecfg, target, vocab):
    """The paper's one layer, and two (a plain Llama layer after `midlayer`): every test of it runs on both."""
    torch.manual_seed(2)
    d = Eagle3Drafter(replace(ecfg, num_layers=request.param), target, *vocab).eval()
    with torch.no_grad():  # norms away from 1, so a mixed-up norm shows in the logits
        for name, p in d.named_parameters():
            if p.requires_grad and name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return d


def tcfg(**kw) -> TrainConfig:
    base = dict(epochs=50, max_steps=10, batch_size=2, lr=3e-3, checkpoint_every=4, device="cpu", seed=0)
    return TrainConfig(**(base | kw))
