"""DDTree budget evaluation: a draft tree from one DFlash block, verified in one target pass.

Construction (Ringel & Romano 2026, "Accelerating Speculative Decoding with Block Diffusion
Draft Trees", arXiv 2604.12989, the method: best-first heap tree construction and the
ancestor-only verification mask; it reuses DFlash drafters, arXiv 2602.06036, unchanged).
One drafter pass gives a distribution q_d over the token at each block slot d = 1..B-1.
Under the factorized surrogate, a root-to-node path t_1..t_d has probability prod q_i(t_i), and
the expected acceptance length of a tree is the sum of its nodes' path probabilities; since a
path's probability never exceeds its parent's, taking nodes best-first from a heap gives an
ancestor-closed tree that maximizes that sum under a node budget. Children of a node at depth
d are tokens of slot d+1, in descending q_{d+1}; the heap holds, per tree node, its likeliest
child not yet taken, and taking a node pushes its next sibling and its own first child.
Background: EAGLE-2 (arXiv 2406.16858) also ranks draft-tree nodes by path confidence and
Sequoia (arXiv 2402.12374) sizes a tree for a budget; both need a drafter pass per depth,
DDTree none. Sources read: the paper's abstract and project page and descriptions of peer
ports (vLLM, SGLang, lucebox), not the paper's section text; the budget unit below is ours.

Budget (this module's definition, so that 1 is the plain block): budget b verifies
`b * (B-1)` draft nodes, b times the plain block's verify width. The tree is seeded with the
plain block's chain (the drafter's argmax at every slot, exactly `propose`'s drafts; some
peer ports seed the chain the same way) and the remaining `(b-1) * (B-1)` nodes are taken
best-first. So budget 1 is the plain block token for token, and each budget's tree contains
the smaller ones' (the heap pops in a fixed order), so for a given prefix acceptance can only
grow with the budget. Without the seed, best-first would sometimes trade a deep chain node
for a likelier sibling near the root; that differs only on low-probability nodes.

Verification: prefix + anchor + the flattened tree (parents before children) in one plain
target forward with a 4D additive float mask: prefix rows causal, a tree node sees the whole
prefix, the anchor, its ancestors and itself; position id = anchor position + depth. With
transformers' eager and sdpa Qwen3 a causal float mask gives bit-identical logits to the
default mask (so budget 1 equals `speculative_generate` exactly); a boolean 4D mask is added
to the scores by the eager path as 0/1 and is silently wrong there, hence the float mask.
Acceptance walks from the anchor along the child whose token is the target's greedy token,
then takes the target's token at the last node (the bonus). Greedy only (temperature 0).

What it does not know: KV caches (it re-runs the whole prefix every step, like `decode`),
EAGLE-3 (it drafts a chain token by token; `supports` says no), stores or reports beyond
the markdown lines of `render_ddtree` and the PNG of `plot_ddtree`.

Key trade-off: the tree is built on the CPU with a Python heap (O(N log N) per step, N nodes)
and verified uncached: simple and exact against the chain; serving code would batch both.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from draftflow import progress
from draftflow.config import EvaluateConfig
from draftflow.drafters.registry import spec_for_architecture
from draftflow.evaluation.decode import (
    RoundFn,
    _finish,
    acceptance_stats,
    capture_taps,
    check_lossless,
    greedy_generate,
)
from draftflow.layers import hf_hidden_state_index

logger = logging.getLogger(__name__)
ROOT = -1  # the parent id of depth-1 nodes: the anchor
PLOT = "ddtree_tau_per_budget.png"


@dataclass(frozen=True)
class DraftTree:
    """A flattened draft tree; node i drafts the token at (anchor position + depths[i]).

    Nodes are in insertion order, so a parent always comes before its children.
    `scores` are log path probabilities under the drafter's factorized surrogate.
    """

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    scores: list[float]

    def __len__(self) -> int:
        return len(self.tokens)

    def ancestor_mask(self) -> torch.Tensor:
        """(N, N) bool: entry [i, j] is True when node j is node i or one of its ancestors."""
        n = len(self)
        mask = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p != ROOT:
                mask[i] |= mask[p]  # parents come first: their row is complete
        return mask


def supports(drafter) -> bool:
    """DDTree needs per-position distributions from one pass: kinds whose spec has `block_logits` (DFlash)."""
    return spec_for_architecture(drafter.config.architecture).block_logits is not None


def budget_nodes(budget: int, drafts: int) -> int:
    """Draft nodes verified at `budget`: budget x the plain block's drafts (B-1)."""
    if budget < 1:
        raise ValueError(f"DDTree budget must be >= 1 (1 = the plain block), got {budget}")
    return budget * drafts


def _ranked(logits: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """Per slot, the k likeliest tokens (argmax first, as `propose` picks it) and their log-probs."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    vals, idx = logp.topk(min(k, logp.shape[-1]), dim=-1)
    tokens, scores = idx.tolist(), vals.tolist()
    for d, best in enumerate(logits.argmax(-1).tolist()):  # a tie must not reorder the chain
        if tokens[d][0] != best:
            tokens[d] = ([best] + [t for t in tokens[d] if t != best])[: len(tokens[d])]
            scores[d] = logp[d, tokens[d]].tolist()
    return tokens, scores


def build_tree(slot_logits: torch.Tensor, nodes: int) -> DraftTree:
    """The plain chain plus best-first nodes up to `nodes` (see the module docstring).

    Args:
        slot_logits: (D, V) drafter logits of block slots 1..D (D = B-1): depth d uses row d-1.
        nodes: the node budget, at least D (`budget_nodes`).

    Returns:
        The tree; its first D nodes are the chain of argmax tokens, the rest in pop order
        (non-increasing path probability).
    """
    depth_max = slot_logits.shape[0]
    assert nodes >= depth_max, "a budget always covers the plain block"
    ranked, logps = _ranked(slot_logits, nodes)
    tree = DraftTree([], [], [], [])
    heap: list[tuple[float, int, int, int, int]] = []  # (-path log-prob, push order, parent, depth, rank)
    pushes = itertools.count()  # ties pop in push order: deterministic

    def push(parent: int, depth: int, rank: int) -> None:
        if depth <= depth_max and rank < len(ranked[depth - 1]):
            base = tree.scores[parent] if parent != ROOT else 0.0
            heapq.heappush(heap, (-(base + logps[depth - 1][rank]), next(pushes), parent, depth, rank))

    def add(parent: int, depth: int, rank: int, first_child: bool) -> None:
        base = tree.scores[parent] if parent != ROOT else 0.0
        tree.tokens.append(ranked[depth - 1][rank])
        tree.parents.append(parent)
        tree.depths.append(depth)
        tree.scores.append(base + logps[depth - 1][rank])
        push(parent, depth, rank + 1)  # the next sibling
        if first_child:
            push(len(tree) - 1, depth + 1, 0)

    for d in range(1, depth_max + 1):  # the seed: the plain block's chain (its rank-0 children are the chain)
        add(d - 2 if d > 1 else ROOT, d, 0, first_child=False)
    while heap and len(tree) < nodes:
        _, _, parent, depth, rank = heapq.heappop(heap)
        add(parent, depth, rank, first_child=True)
    return tree


def tree_mask(prefix: int, tree: DraftTree, dtype: torch.dtype) -> torch.Tensor:
    """(1, 1, L, L) additive float mask for `prefix` causal tokens (anchor included) then the tree.

    0 where attention is allowed, dtype's minimum elsewhere (transformers adds it to the scores).
    """
    n, L = len(tree), prefix + len(tree)
    allowed = torch.ones(L, L, dtype=torch.bool).tril()
    allowed[prefix:, prefix:] = tree.ancestor_mask()  # the tree part: ancestors and self only
    mask = torch.zeros(L, L, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    assert n == 0 or bool(allowed[prefix:, :prefix].all())
    return mask[None, None]


@torch.no_grad()
def verify_tree(
    target, ids: list[int], tree: DraftTree, layer_ids: list[int], round_features: RoundFn | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over `ids` (prefix ending in the anchor) + the flattened tree.

    Returns:
        logits (L, V) and tap features (L, n_taps * D), rows in flattened order
        (`capture_taps`'s layout); tree row j sits at len(ids) + j.
    """
    device = target.get_input_embeddings().weight.device
    dtype = target.get_input_embeddings().weight.dtype
    a = len(ids) - 1  # the anchor's position
    x = torch.tensor([ids + tree.tokens], dtype=torch.long, device=device)
    pos = torch.tensor([list(range(len(ids))) + [a + d for d in tree.depths]], device=device)
    mask = tree_mask(len(ids), tree, dtype).to(device)
    out = target(input_ids=x, attention_mask=mask, position_ids=pos, output_hidden_states=True, use_cache=False)
    feats = torch.cat([out.hidden_states[hf_hidden_state_index(lid)] for lid in layer_ids], dim=-1)[0]
    if round_features is not None:
        feats = round_features(feats)
    return out.logits[0], feats


def accept_path(tree: DraftTree, greedy: list[int]) -> tuple[list[int], int]:
    """The longest root-to-node path the target agrees with, and the bonus token.

    Args:
        greedy: the target's greedy token after the anchor (index 0) and after each node (1 + j).

    Returns:
        (accepted node ids, root first; the target's token after the last of them).
    """
    children: dict[tuple[int, int], int] = {(p, t): j for j, (p, t) in enumerate(zip(tree.parents, tree.tokens))}
    path, node, nxt = [], ROOT, greedy[0]
    while (node, nxt) in children:
        node = children[(node, nxt)]
        path.append(node)
        nxt = greedy[1 + node]
    return path, nxt


def tree_generate(
    target,
    drafter,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_ids: set[int],
    budget: int,
    round_features: RoundFn | None = None,
) -> tuple[list[int], list[int]]:
    """Greedy speculative decoding with a DDTree of `budget` (x the block's drafts) nodes per step.

    Same contract as `decode.speculative_generate` (tokens, per-step acceptance lengths counting
    only kept tokens); budget 1 returns exactly what it returns.

    Raises:
        ValueError: budget < 1.
    """
    layer_ids, drafts = drafter.config.target_layer_ids, drafter.config.block_size - 1
    nodes = budget_nodes(budget, drafts)
    block_logits = spec_for_architecture(drafter.config.architecture).block_logits  # the kind's one drafting pass
    logits, feats = capture_taps(target, prompt_ids, layer_ids, round_features)
    seq = list(prompt_ids)  # tokens the target has read; the anchor sits at position len(seq)
    out, done = _finish([int(logits[-1].argmax())], max_new_tokens, eos_ids)
    accept: list[int] = []
    while not done:
        anchor, n = out[-1], len(seq)
        tree = build_tree(block_logits(drafter, anchor, feats[:n])[1:], nodes)
        logits, vfeats = verify_tree(target, seq + [anchor], tree, layer_ids, round_features)
        path, bonus = accept_path(tree, logits[n:].argmax(-1).tolist())
        drafted = [tree.tokens[j] for j in path]
        seq += [anchor] + drafted
        kept, done = _finish(out + drafted + [bonus], max_new_tokens, eos_ids)
        accept.append(len(kept) - len(out))
        out = kept
        # Rows of the prefix and of the accepted path saw exactly the accepted tokens (ancestor mask).
        feats = torch.cat([vfeats[: n + 1], vfeats[[n + 1 + j for j in path]]])
    return out, accept


def evaluate_ddtree(
    target,
    drafter,
    prompts: list[list[int]],
    budgets: list[int],
    ecfg: EvaluateConfig,
    eos_ids: set[int],
    round_features: RoundFn | None = None,
    reference: list[list[int]] | None = None,
) -> dict[str, dict] | None:
    """τ per DDTree budget on the evaluation prompts, each decode checked lossless.

    Args:
        prompts: token id lists; the first `ecfg.num_prompts` are used (all when null), as in
            `decode.evaluate_prompts`.
        budgets: DDTree budgets (>= 1; 1 = the plain block).
        reference: greedy outputs of those prompts when already known (the chain's checked
            outputs); a prompt whose tree decode differs from it (or all, when None) is judged
            against `greedy_generate`, the uncached reference, instead.

    Returns:
        {str(budget): acceptance_stats + nodes (draft nodes verified per step), tokens, prompts},
        budgets in ascending order (str keys, as in report.json); None for a drafter that is not
        DFlash (`supports`): EAGLE-3 drafts token by token and has no per-position distributions.

    Raises:
        LosslessError: a tree decode differs from greedy (prompt index and position).
        ValueError: a budget < 1 (the config rejects it first).
    """
    if not supports(drafter):
        logger.info("DDTree budgets: skipped, DFlash drafters only")
        return None
    chosen = prompts[: ecfg.num_prompts] if ecfg.num_prompts else prompts
    chosen = chosen[: ecfg.ddtree_prompts] if ecfg.ddtree_prompts else chosen
    refs = list(reference or [None] * len(chosen))
    drafts = drafter.config.block_size - 1
    drafter.eval()
    report: dict[str, dict] = {}
    for b, budget in enumerate(sorted(set(budgets))):
        lengths, tokens = [], 0
        for i, prompt in enumerate(chosen):
            progress.within("evaluate", b * len(chosen) + i, len(set(budgets)) * len(chosen), "tree decodes")
            spec, acc = tree_generate(target, drafter, prompt, ecfg.max_new_tokens, eos_ids, budget, round_features)
            if spec != refs[i]:  # none given, or from another (KV-cached) loop: judge by the uncached greedy
                refs[i] = greedy_generate(target, prompt, ecfg.max_new_tokens, eos_ids)
            check_lossless(i, spec, refs[i])
            lengths += acc
            tokens += len(spec)
        stats = acceptance_stats(lengths, drafts + 1)
        report[str(budget)] = stats | {"nodes": budget_nodes(budget, drafts), "tokens": tokens, "prompts": len(chosen)}
        logger.info(
            "DDTree budget %d (%d nodes): tau %s over %d steps",
            budget,
            budget_nodes(budget, drafts),
            _fmt(stats["tau"]),
            stats["steps"],
        )
    return report


def ddtree_taus(stats: dict[str, dict] | None) -> dict[str, float | None] | None:
    """τ per budget (the evaluate manifest's `extra.ddtree`); None when DDTree was not run."""
    return None if stats is None else {budget: s["tau"] for budget, s in stats.items()}


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def render_ddtree(stats: dict[str, dict] | None) -> list[str]:
    """Markdown lines of the report's DDTree section (None or {}: why there is no curve)."""
    lines = ["", "## DDTree budgets (one drafter pass, one tree-masked target pass per step)", ""]
    if stats is None:
        return lines + [
            "DFlash only: this drafter drafts token by token, so it has no per-position "
            "distributions to build a DDTree from."
        ]
    if not stats:
        return lines + ["No budgets configured (`evaluate.ddtree_budgets`)."]
    base = stats.get("1", {}).get("tau")
    lines += [
        "Budget b verifies b x (B-1) draft nodes: the plain block's chain plus the best-first nodes by "
        "path probability under the drafter's per-position distributions (Ringel & Romano 2026, "
        "arXiv 2604.12989). Budget 1 is the plain block. Lossless: yes.",
        "",
        "| budget | draft nodes per step | τ | τ / τ(plain block) | steps |",
        "|---|---|---|---|---|",
    ]
    for budget, s in stats.items():
        ratio = f"{s['tau'] / base:.2f}x" if base and s["tau"] is not None else "n/a"
        lines.append(f"| {budget} | {s['nodes']} | {_fmt(s['tau'])} | {ratio} | {s['steps']} |")
    return lines  # the plot (`plot_ddtree`) is embedded with the report's other plots


def plot_ddtree(stats: dict[str, dict] | None, folder: str | Path) -> list[str]:
    """τ against draft nodes per step, one point per budget, as a PNG in `folder`.

    Returns:
        The file names written: none without budgets or without matplotlib.
    """
    if not stats:
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError:
        return []
    nodes, taus = [s["nodes"] for s in stats.values()], [s["tau"] or 0.0 for s in stats.values()]
    fig = Figure(figsize=(6, 4), dpi=100)
    ax = fig.add_subplot()
    ax.plot(nodes, taus, marker="o")
    for budget, x, y in zip(stats, nodes, taus):
        ax.annotate(f"b={budget}", (x, y), textcoords="offset points", xytext=(4, -12))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft nodes verified per step (budget x (B-1))")
    ax.set_ylabel("mean acceptance length τ")
    ax.set_title("evaluate: DDTree τ per budget (b=1: the plain block)")
    fig.tight_layout()
    fig.savefig(Path(folder) / PLOT, format="png", metadata={"Software": None})  # no version: same bytes per run
    return [PLOT]
