"""DDTree budgets: tree construction, the tree mask, budget 1 == the plain block, losslessness, τ vs budget."""

from __future__ import annotations

import copy
import itertools
import math
from collections import Counter

import pytest
import torch
from transformers import Qwen3ForCausalLM

from draftflow.config import DrafterConfig, EvaluateConfig, TrainConfig, load_config
from draftflow.drafters.dflash import spec as dflash_kind
from draftflow.drafters.dflash.model import DFlashDrafter
from draftflow.drafters.eagle3.config import Eagle3Config
from draftflow.drafters.eagle3.model import Eagle3Drafter
from draftflow.drafters.eagle3.vocab import draft_vocab
from draftflow.errors import ConfigError
from draftflow.evaluation.ddtree import (
    PLOT,
    ROOT,
    DraftTree,
    accept_path,
    budget_nodes,
    build_tree,
    ddtree_taus,
    evaluate_ddtree,
    plot_ddtree,
    render_ddtree,
    supports,
    tree_generate,
    tree_mask,
    verify_tree,
)
from draftflow.evaluation.decode import capture_taps, greedy_generate, speculative_generate
from draftflow.evaluation.summary import console_lines, headline
from draftflow.training.loop import train_drafter
from tests.conftest import MASK_ID, B, greedy_samples

D = B - 1  # drafts per block


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, MASK_ID, (8, 5), generator=g).tolist()


@pytest.fixture(scope="module")
def untrained(target, dcfg):
    torch.manual_seed(1)
    return DFlashDrafter(dcfg, target).eval()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, target, dcfg, prompts):
    """A drafter trained briefly on the target's own greedy continuations of `prompts` (~4 s)."""
    samples = greedy_samples(target, dcfg, prompts)
    tcfg = TrainConfig(
        epochs=100, max_steps=150, batch_size=2, lr=3e-3, num_anchors=8, checkpoint_every=1000, device="cpu"
    )
    out = tmp_path_factory.mktemp("ddtree-drafter")
    train_drafter(samples, target, dcfg, tcfg, str(out))
    return DFlashDrafter.load(out, target).eval()


def random_logits(depth: int, vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    return scale * torch.randn(depth, vocab, generator=torch.Generator().manual_seed(seed))


def path_of(tree: DraftTree, j: int) -> list[int]:
    """Node ids root-first down to j."""
    path = []
    while j != ROOT:
        path.append(j)
        j = tree.parents[j]
    return path[::-1]


# ----------------------------------------------------------------------------- construction


@pytest.mark.parametrize("nodes", [D, 2 * D, 5 * D, 40])
def test_tree_respects_budget_parents_first_and_scores_are_path_log_probs(nodes):
    logits = random_logits(D, 50, seed=nodes)
    logp = torch.log_softmax(logits, -1)
    tree = build_tree(logits, nodes)
    assert len(tree) == nodes
    assert tree.tokens[:D] == logits.argmax(-1).tolist()  # the plain block's chain comes first
    assert tree.parents[:D] == [ROOT, *range(D - 1)]
    seen = set()
    for j, (p, d, t) in enumerate(zip(tree.parents, tree.depths, tree.tokens)):
        assert p < j and d == (1 if p == ROOT else tree.depths[p] + 1) and 1 <= d <= D
        assert (p, t) not in seen  # no two siblings draft the same token
        seen.add((p, t))
        want = sum(float(logp[tree.depths[i] - 1, tree.tokens[i]]) for i in path_of(tree, j))
        assert math.isclose(tree.scores[j], want, rel_tol=1e-5, abs_tol=1e-5)
    added = tree.scores[D:]
    assert added == sorted(added, reverse=True)  # best-first: pops never get likelier


def test_added_nodes_are_the_likeliest_outside_the_chain_and_budgets_nest():
    """Brute force over every path of a small vocabulary: DDTree's optimum given the chain seed."""
    vocab = 5
    logits = random_logits(D, vocab, seed=7, scale=1.5)
    logp = torch.log_softmax(logits, -1)
    chain = tuple(logits.argmax(-1).tolist())
    every = [p for d in range(1, D + 1) for p in itertools.product(range(vocab), repeat=d)]
    outside = sorted(
        (p for p in every if p != chain[: len(p)]), key=lambda p: -sum(float(logp[i, t]) for i, t in enumerate(p))
    )
    big = build_tree(logits, D + 30)
    for nodes in (D, D + 1, D + 7, D + 30):
        tree = build_tree(logits, nodes)
        assert tree.tokens == big.tokens[:nodes] and tree.parents == big.parents[:nodes]  # nested
        got = {tuple(tree.tokens[i] for i in path_of(tree, j)) for j in range(D, nodes)}
        best = outside[: nodes - D]
        cutoff = sum(float(logp[i, t]) for i, t in enumerate(best[-1])) if best else 0.0
        assert {p for p in best if sum(float(logp[i, t]) for i, t in enumerate(p)) > cutoff + 1e-6} <= got
        assert len(got) == nodes - D


def test_tree_mask_is_prefix_plus_ancestors_and_self():
    tree = build_tree(random_logits(D, 40, seed=3), 4 * D)
    prefix = 6
    mask = tree_mask(prefix, tree, torch.float32)
    assert mask.shape == (1, 1, prefix + len(tree), prefix + len(tree))
    allowed = mask[0, 0] == 0
    assert set(mask.unique().tolist()) == {0.0, torch.finfo(torch.float32).min}
    assert torch.equal(allowed[:prefix, :prefix], torch.ones(prefix, prefix, dtype=torch.bool).tril())
    assert not allowed[:prefix, prefix:].any() and allowed[prefix:, :prefix].all()
    for i in range(len(tree)):
        assert {j for j in range(len(tree)) if allowed[prefix + i, prefix + j]} == set(path_of(tree, i))


def test_accept_path_walks_the_targets_tokens_and_returns_the_bonus():
    tree = DraftTree(tokens=[5, 6, 7, 8, 9], parents=[ROOT, 0, ROOT, 2, 3], depths=[1, 2, 1, 2, 3], scores=[0.0] * 5)
    # greedy[0] follows the anchor, greedy[1 + j] follows node j
    assert accept_path(tree, [7, 0, 0, 8, 9, 4]) == ([2, 3, 4], 4)
    assert accept_path(tree, [5, 1, 0, 0, 0, 0]) == ([0], 1)
    assert accept_path(tree, [3, 0, 0, 0, 0, 0]) == ([], 3)


# ----------------------------------------------------------------------------- verification


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_a_4d_float_causal_mask_gives_the_default_forward_bit_for_bit(target, impl):
    cfg = copy.deepcopy(target.config)
    cfg._attn_implementation = impl
    model = Qwen3ForCausalLM(cfg)
    model.load_state_dict(target.state_dict())
    model.eval()
    assert model.config._attn_implementation == impl
    ids = list(range(3, 23))
    plain = DraftTree([], [], [], [])
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    got, _ = verify_tree(model, ids, plain, [0])
    assert torch.equal(got, ref)


def test_every_tree_node_sees_exactly_its_path(target):
    """Node j's logits equal a plain forward over prefix + anchor + the path to j (float tolerance)."""
    ids = [11, 42, 7, 99, 5, 250]
    tree = build_tree(random_logits(D, 320, seed=5), 4 * D)
    logits, feats = verify_tree(target, ids, tree, [0, 2])
    for j in range(len(tree)):
        path = [tree.tokens[i] for i in path_of(tree, j)]
        ref_logits, ref_feats = capture_taps(target, ids + path, [0, 2])
        torch.testing.assert_close(logits[len(ids) + j], ref_logits[-1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(feats[len(ids) + j], ref_feats[-1], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("which", ["untrained", "trained"])
def test_budget_1_is_the_plain_block(request, target, prompts, which):
    drafter = request.getfixturevalue(which)
    for p in prompts[:5]:
        chain = speculative_generate(target, drafter, p, 13, set())
        assert tree_generate(target, drafter, p, 13, set(), budget=1) == chain  # tokens and per-step lengths


@pytest.mark.parametrize("which", ["untrained", "trained"])
def test_every_budget_is_lossless(request, target, prompts, which):
    drafter = request.getfixturevalue(which)
    ecfg = EvaluateConfig(max_new_tokens=12, num_prompts=4)
    stats = evaluate_ddtree(target, drafter, prompts, [8, 1, 2, 4], ecfg, set())  # raises LosslessError otherwise
    assert list(stats) == ["1", "2", "4", "8"]
    for budget, s in stats.items():
        assert s["nodes"] == int(budget) * D and s["prompts"] == 4 and s["tokens"] == 4 * 12
        assert sum(s["accept_histogram"]) == s["steps"] and len(s["accept_histogram"]) == B + 1
    if which == "untrained":  # a reference that is not greedy (another loop's) is re-judged, not trusted blindly
        wrong = [[t + 1 for t in greedy_generate(target, p, 12, set())] for p in prompts[:4]]
        assert evaluate_ddtree(target, drafter, prompts, [2], ecfg, set(), reference=wrong)["2"] == stats["2"]
    if which == "trained":  # the trained drafter accepts drafts at all; trees accept more
        assert stats["1"]["tau"] > 1.5 and stats["8"]["tau"] >= stats["1"]["tau"]


def test_acceptance_per_step_never_drops_with_the_budget(target, trained, prompts):
    """For one prefix, a bigger budget's tree contains the smaller one's, so it accepts at least as much.

    (Over a whole generation τ can in principle dip: different acceptances move the step boundaries.)
    """
    layer_ids = trained.config.target_layer_ids
    for p in prompts[:4]:
        full = p + greedy_generate(target, p, 12, set())
        for cut in (len(p) + 1, len(p) + 5, len(p) + 9):
            seq, anchor = full[: cut - 1], full[cut - 1]
            _, feats = capture_taps(target, seq, layer_ids)
            slots = dflash_kind.draft_block(trained, anchor, feats)[1:]
            lengths = []
            for budget in (1, 2, 4, 8):
                tree = build_tree(slots, budget_nodes(budget, D))
                logits, _ = verify_tree(target, seq + [anchor], tree, layer_ids)
                lengths.append(len(accept_path(tree, logits[len(seq) :].argmax(-1).tolist())[0]))
            assert lengths == sorted(lengths)


def test_tau_grows_with_the_budget_when_the_truth_is_the_runner_up(monkeypatch, target, untrained, prompts):
    """A scripted drafter ranks the target's true token second at every slot (p 0.73 / 0.27): the chain
    never accepts a draft; 6 nodes hold the true depth-1 token, 12 the true depth-2 path, 24 the whole
    block (all 14 nodes of probability >= 0.27^3), so τ is 1, 2, 3, 4 up to the last, cut step."""
    p, layer_ids = prompts[0], untrained.config.target_layer_ids
    truth = p + greedy_generate(target, p, 40, set())

    def runner_up(drafter, anchor, ctx):
        n = ctx.shape[0]  # the anchor's position
        # The context is the accepted path's own features, not rows of the flattened tree.
        torch.testing.assert_close(ctx, capture_taps(target, truth[:n], layer_ids)[1], rtol=1e-5, atol=1e-5)
        logits = torch.full((B, 320), -30.0)
        for k in range(1, B):
            logits[k, (truth[n + k] + 1) % 320] = 1.0
            logits[k, truth[n + k]] = 0.0
        return logits

    import dataclasses

    from draftflow.evaluation import ddtree

    scripted = dataclasses.replace(dflash_kind.SPEC, block_logits=runner_up)  # the kind's capability, scripted
    monkeypatch.setattr(ddtree, "spec_for_architecture", lambda architecture: scripted)
    ecfg = EvaluateConfig(max_new_tokens=25)
    stats = evaluate_ddtree(target, untrained, [p], [1, 2, 4, 8], ecfg, set())
    taus = [stats[b]["tau"] for b in ("1", "2", "4", "8")]
    assert taus[0] == 1.0 and taus == sorted(taus) and len(set(taus)) == 4
    hist = stats["8"]["accept_histogram"]
    assert hist[B] >= stats["8"]["steps"] - 1  # every step (but maybe the last, cut one) accepts the whole block


# ----------------------------------------------------------------------------- config, kinds, report


def test_a_budget_below_1_is_a_one_line_config_error(target, untrained, prompts):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["evaluate.ddtree_budgets=[1, 0]"])
    assert "evaluate.ddtree_budgets" in str(err.value) and "\n" not in str(err.value)
    assert load_config(None).evaluate.ddtree_budgets == [1, 4, 8, 16, 32]
    with pytest.raises(ValueError, match="budget must be >= 1"):
        tree_generate(target, untrained, prompts[0], 4, set(), budget=0)


def test_eagle3_drafters_are_skipped(target, prompts):
    d2t, t2d = draft_vocab(Counter(range(200)), 320, 200)
    cfg = Eagle3Config.from_target(target.config, DrafterConfig(kind="eagle3", target_layer_ids=[1, 2, 3]), 200)
    eagle = Eagle3Drafter(cfg, target, torch.tensor(d2t), torch.tensor(t2d)).eval()
    assert not supports(eagle)
    assert evaluate_ddtree(target, eagle, prompts, [1, 4], EvaluateConfig(max_new_tokens=4), set()) is None
    assert ddtree_taus(None) is None
    assert any("DFlash only" in line for line in render_ddtree(None))


def test_report_section_lists_every_budget(tmp_path):
    stats = {"1": {"tau": 2.0, "nodes": 7, "steps": 10}, "4": {"tau": 3.0, "nodes": 28, "steps": 7}}
    text = "\n".join(render_ddtree(stats))
    assert "| 1 | 7 | 2.000 | 1.00x | 10 |" in text and "| 4 | 28 | 3.000 | 1.50x | 7 |" in text
    assert "arXiv 2604.12989" in text
    assert ddtree_taus(stats) == {"1": 2.0, "4": 3.0}
    assert "No budgets" in "\n".join(render_ddtree({}))
    stats["16"] = {"tau": 3.5, "nodes": 112, "steps": 5}  # what `draftflow run` prints, budgets in numeric order
    assert console_lines(headline({"ddtree": stats})) == [
        "DDTree tau per budget (x block drafts): 1 2.000, 4 3.000, 16 3.500"
    ]
    assert console_lines(headline({"ddtree": None})) == []
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    assert plot_ddtree(stats, tmp_path / "a") == plot_ddtree(stats, tmp_path / "b") == [PLOT]
    png = (tmp_path / "a" / PLOT).read_bytes()
    assert png.startswith(b"\x89PNG") and png == (tmp_path / "b" / PLOT).read_bytes()  # same bytes every run
    assert plot_ddtree(None, tmp_path) == [] and plot_ddtree({}, tmp_path) == []
