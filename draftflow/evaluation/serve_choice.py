"""Serve settings chosen from measured costs: how many drafts to serve with, and whether to speculate at all.

Why: a drafter's acceptance falls steeply by position (SmolLM2's DFlash: 26%, 4%, 0.6%), every extra draft
costs a verification slot, and the drafting pass costs what it costs on this hardware; so the best number of
drafts k, and whether any beats plain decoding, depend on the hardware and the batch. For each proposer
(the drafter, vLLM's n-gram lookup) and each k, at each batch size:

    predicted speedup(k) = (1 + p * (tau(k) - 1)) * t_step / (p * (t_verify(k) + t_draft(k)) + (1 - p) * t_step + o)

- tau(k) = 1 + sum_{j<=k} a_j, a_j = P(at least j drafts accepted) on a drafting step, measured with the full
  chain: a chain accepts draft j only if drafts 1..j-1 were accepted, so cutting it after k drafts keeps a_1..a_k;
- t_step: the plain decode step; t_verify(k): the target's forward over the anchor and k drafts; t_draft(k):
  one drafting pass proposing k drafts; all measured on the serving engine (`Costs`);
- p: the share of steps that draft at all (1 for a drafter; n-gram lookup drafts only where it finds a match);
- o: what every step of the method costs beyond that model, read off its measured run (the speculative path's
  own work: n-gram lookup's undrafted steps are not plain steps), the same for every k.
Leviathan et al., ICML 2023, Theorem 3.8 is the special case t_verify = t_step, t_draft = k * c * t_step.

The best setting wins when its predicted speedup beats plain decoding by `MARGIN`; otherwise the choice is
plain decoding, said plainly with the best figure. What it does not know: vLLM, timing, reports (the
evaluate stage measures and records; `draftflow.evaluation.served` serves the choice and measures it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MARGIN = 1.02  # a setting must be predicted at least 2% faster than plain decoding: measurements are noisy


@dataclass(frozen=True)
class Proposer:
    """One way of drafting, as the choice sees it.

    Attributes:
        name: its setting's prefix (`dflash`, `eagle3`, `ngram`).
        acceptance: a_j for j = 1..K, P(at least j drafts accepted), measured with its longest chain.
        draft_s: k -> seconds of one drafting pass proposing k drafts (k = 1..K), at the batch the costs are for.
        drafting_share: the share of steps that draft (p above).
        overhead_s: seconds every step of it costs beyond verifying and drafting (o above).
    """

    name: str
    acceptance: list[float]
    draft_s: dict[int, float]
    drafting_share: float = 1.0
    overhead_s: float = 0.0

    @property
    def max_drafts(self) -> int:
        return min(len(self.acceptance), max(self.draft_s, default=0))


@dataclass(frozen=True)
class Costs:
    """Seconds of one target step at one batch size: plain, and verifying k drafts (k -> seconds)."""

    step_s: float
    verify_s: dict[int, float]


@dataclass(frozen=True)
class Choice:
    """The setting to serve at one batch size, and what every candidate was predicted to give."""

    setting: str  # "plain" or "<proposer>:k=<k>"
    predicted: float  # its predicted speedup over plain decoding (1.0 for plain)
    best_speculative: str  # the best speculative setting even when plain won
    best_predicted: float
    table: dict[str, dict[str, float]] = field(default_factory=dict)  # setting -> {"tau", "predicted"}

    @property
    def proposer(self) -> str | None:
        return None if self.setting == "plain" else self.setting.split(":", 1)[0]

    @property
    def drafts(self) -> int | None:
        return None if self.setting == "plain" else int(self.setting.rsplit("=", 1)[1])


def tau_at(acceptance: list[float], k: int) -> float:
    """Mean tokens per target step with a chain cut after k drafts."""
    return 1.0 + sum(acceptance[:k])


def predict(p: Proposer, costs: Costs, k: int) -> float:
    """The predicted speedup of serving `p` with k drafts (see the module docstring)."""
    share = p.drafting_share
    step = share * (costs.verify_s[k] + p.draft_s[k]) + (1.0 - share) * costs.step_s + p.overhead_s
    return (1.0 + share * (tau_at(p.acceptance, k) - 1.0)) * costs.step_s / step


def choose(proposers: list[Proposer], costs: Costs, margin: float = MARGIN) -> Choice:
    """The setting to serve at the batch size `costs` were measured at.

    Raises:
        ValueError: a step cost that is not positive (a timer that measured nothing).
    """
    if costs.step_s <= 0 or any(v <= 0 for v in costs.verify_s.values()):
        raise ValueError(f"step costs must be positive: step {costs.step_s}, verify {costs.verify_s}")
    table: dict[str, dict[str, float]] = {}
    for p in proposers:
        for k in range(1, p.max_drafts + 1):
            if k in costs.verify_s and k in p.draft_s:
                table[f"{p.name}:k={k}"] = {"tau": round(tau_at(p.acceptance, k), 4),
                                            "predicted": round(predict(p, costs, k), 4)}
    if not table:
        return Choice("plain", 1.0, "none", 0.0, table)
    best = fastest(table)
    best_x = table[best]["predicted"]
    if best_x >= margin:
        return Choice(best, best_x, best, best_x, table)
    return Choice("plain", 1.0, best, best_x, table)


def fastest(table: dict[str, dict[str, float]], skip: set[str] = frozenset()) -> str | None:
    """The setting of `table` (setting -> {"predicted": speedup, ...}) predicted fastest, leaving out `skip`; ties go
    to fewer drafts. None when nothing is left."""
    left = [s for s in table if s not in skip]
    return max(left, key=lambda s: (table[s]["predicted"], -int(s.rsplit("=", 1)[1])), default=None)


def advice(choice: dict[str, dict] | None) -> str | None:
    """What the costs chose, in one line printed under the serve lines (which stay runnable as printed): plainly,
    to serve without speculation when plain decoding won at every batch size. `choice`: batch size (as text) ->
    the evaluate report's choice; None without one."""
    if not choice:
        return None
    ordered = sorted(choice.items(), key=lambda kv: int(kv[0]))
    if all(c["setting"] == "plain" for _, c in ordered):
        figures = ", ".join(f"best drafter setting {c['best_speculative']} x{c['best_predicted']:.2f} at batch {b}"
                            for b, c in ordered)
        return f"on this hardware serve without speculation: {figures}"
    return "chosen from measured costs: " + ", ".join(
        f"batch {b} {'plain decoding' if c['setting'] == 'plain' else c['setting']} x{c['predicted']:.2f}"
        for b, c in ordered)


# How a proposer's drafting pass scales with k drafts, by its name (`drafting_costs`' `how`): a DFlash block is one
# pass of k+1 queries in vLLM, EAGLE-3 one pass a draft, n-gram / prompt lookup drafts nothing itself.
DRAFTING = {"dflash": "block", "eagle3": "chain", "eagle": "chain", "ngram": "free", "prompt_lookup": "free"}


def drafting_costs(full_s: float, most: int, how: str) -> dict[int, float]:
    """Seconds of a drafting pass for k = 1..`most` drafts from its measured cost at `most`: "block" (one pass of
    k+1 queries, DFlash in vLLM), "chain" (one pass a draft, EAGLE-3) or "free" (n-gram lookup)."""
    scale = {"block": lambda k: (k + 1) / (most + 1), "chain": lambda k: k / most, "free": lambda k: 0.0}[how]
    return {k: full_s * scale(k) for k in range(1, most + 1)}


def verify_from_probe(step_s: float, probe: dict[int, float]) -> dict[int, float]:
    """t_verify(k) from a probe of the serving engine: `probe` maps n new positions (n = 1..K+1) to the seconds
    of one request that computes n positions after a cached context and samples one token. The request's own
    overhead is the same for every n, so verifying k drafts costs a plain step plus probe[k+1] - probe[1], read
    off the probe made non-decreasing (`non_decreasing`): computing more positions never costs less, and a noisy
    dip would otherwise pick its k (winner's curse: SmolLM2's EAGLE-3 at batch 1 probed k = 3 below k = 1, was
    chosen at k = 3, predicted x1.27 and measured x1.09)."""
    if 1 not in probe:
        return {}
    ns = sorted(probe)
    fitted = dict(zip(ns, non_decreasing([probe[n] for n in ns]), strict=True))
    return {n - 1: step_s + fitted[n] - fitted[1] for n in ns if n >= 2}


def non_decreasing(values: list[float]) -> list[float]:
    """The least-squares non-decreasing fit of `values` (pool adjacent violators): each run that falls is replaced
    by its mean, so a sequence that never falls comes back unchanged."""
    blocks: list[list[float]] = []  # [sum, count] of each pooled run
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def spec_step_seconds(batch: int, tau: float | None, tok_s: float | None) -> float | None:
    """Seconds of one speculative step of a served run at `batch`, from its tokens/s and tokens per step."""
    if not tau or not tok_s:
        return None
    return batch * tau / tok_s
