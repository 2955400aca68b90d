"""DFlash training: anchored blocks, the decayed block loss, and a resumable loop.

Per sequence (DFlash paper, arXiv 2602.06036, section on training):
  * up to `num_anchors` random anchors a among supervised positions;
  * block j = [token a_j, mask x (B-1)] at positions a_j..a_j+B-1;
  * slot k predicts token a_j+k at its own position (slot 0 is the given anchor);
  * block j sees context features at positions < a_j, itself bidirectionally,
    and no other block (`draftflow.models.dflash.block_attention_mask`);
  * slot k's cross entropy is weighted by exp(-(k-1)/gamma): early slots
    matter most, since one wrong draft discards the rest of the block.

What it does not know: where features come from (already-loaded
`FeatureSample`s), Prefect, or distributed training. Checkpoints are local folders.

Key trade-off: one sequence per forward pass (variable T and anchor counts),
with `batch_size` sequences by gradient accumulation. No padding logic and
exact per-step normalisation, at the cost of GPU utilisation on short
sequences. Every random choice derives from (seed, step), so a resumed run
equals an uninterrupted one bit for bit on the same device.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from draftflow.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from draftflow.config import TrainConfig
from draftflow.errors import ConfigError
from draftflow.features import FeatureSample
from draftflow.models.dflash import DFlashConfig, DFlashDrafter, block_attention_mask

logger = logging.getLogger(__name__)

IGNORE = -100
# Paper's loss decay per block size: gamma = 7, 5, 4 for B = 16, 10, 8.
PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
METRIC_WINDOW = 20  # steps averaged into the reported metrics


def default_gamma(block_size: int) -> float:
    """The paper's gamma for B = 16/10/8; otherwise (B-1)/2, which tracks those values
    (7.5/4.5/3.5) and keeps the weight of the last slot near exp(-2)."""
    return PAPER_GAMMA.get(block_size, max(0.5, (block_size - 1) / 2))


# ----------------------------------------------------------------------------- batches


@dataclass
class BlockBatch:
    """Drafter inputs and labels for one sequence; Q = n_blocks * B."""

    anchors: torch.Tensor  # (N,) sorted anchor positions
    block_ids: torch.Tensor  # (1, Q)
    block_pos: torch.Tensor  # (1, Q)
    ctx_hidden: torch.Tensor  # (1, T, n_taps*D)
    ctx_pos: torch.Tensor  # (1, T)
    attn_mask: torch.Tensor  # (1, Q, T+Q) bool
    labels: torch.Tensor  # (1, Q) int64, IGNORE at slot 0 and unsupervised targets

    def to(self, device: torch.device | str) -> BlockBatch:
        return BlockBatch(**{k: v.to(device) for k, v in vars(self).items()})


def select_anchors(
    loss_mask: torch.Tensor, block_size: int, num_anchors: int, generator: torch.Generator
) -> torch.Tensor:
    """Uniformly sample up to `num_anchors` anchors, sorted.

    Eligible a: loss_mask[a] is set, a >= 1 (some context exists) and the block fits
    (a + B <= T). Returns an empty (0,) tensor when none is eligible.
    """
    T = loss_mask.numel()
    pos = torch.arange(T)
    ok = loss_mask.bool().cpu() & (pos >= 1) & (pos + block_size <= T)
    cand = pos[ok]
    if cand.numel() > num_anchors:
        cand = cand[torch.randperm(cand.numel(), generator=generator)[:num_anchors]]
    return cand.sort().values


def make_block_batch(sample: FeatureSample, anchors: torch.Tensor, block_size: int, mask_token_id: int) -> BlockBatch:
    """Drafter inputs and labels for given anchors (see module docstring for the rule)."""
    T, B = sample.input_ids.numel(), block_size
    ids = sample.input_ids.to(torch.int64)
    slot = torch.arange(B)  # (B,)
    pos = anchors[:, None] + slot[None, :]  # (N, B) absolute position of every slot
    block_ids = torch.full_like(pos, mask_token_id)
    block_ids[:, 0] = ids[anchors]  # slot 0 holds the anchor token itself
    # Slot k predicts the token at its own position a+k (no shift): label = ids[a+k].
    labels = torch.where(sample.loss_mask.bool()[pos], ids[pos], IGNORE)
    labels[:, 0] = IGNORE  # the anchor is given, not predicted
    return BlockBatch(
        anchors=anchors,
        block_ids=block_ids.reshape(1, -1),
        block_pos=pos.reshape(1, -1),
        ctx_hidden=sample.hidden.reshape(1, T, -1),  # taps concatenated in tap order
        ctx_pos=torch.arange(T)[None],
        attn_mask=block_attention_mask(anchors, B, T)[None],
        labels=labels.reshape(1, -1),
    )


def build_training_batch(
    sample: FeatureSample,
    block_size: int,
    num_anchors: int,
    generator: torch.Generator,
    mask_token_id: int,
) -> BlockBatch | None:
    """Random anchors plus their blocks for one sequence.

    Args:
        sample: one sequence's ids, loss mask and (T, n_taps, D) tap features.
        block_size: B.
        num_anchors: at most this many blocks (paper: 512).
        generator: the only source of randomness (anchor choice).
        mask_token_id: id filling slots 1..B-1.

    Returns:
        A `BlockBatch`, or None when the sequence has no eligible anchor.
    """
    anchors = select_anchors(sample.loss_mask, block_size, num_anchors, generator)
    if anchors.numel() == 0:
        return None
    return make_block_batch(sample, anchors, block_size, mask_token_id)


# ----------------------------------------------------------------------------- loss


@dataclass
class LossStats:
    loss: torch.Tensor  # scalar: weighted CE / weight_sum
    weighted_sum: torch.Tensor  # scalar, differentiable
    weight_sum: float
    correct: torch.Tensor  # (B-1,) correct predictions per slot k=1..B-1
    valid: torch.Tensor  # (B-1,) supervised labels per slot
    leading: torch.Tensor  # (N,) leading correct slots per block

    @property
    def accuracy(self) -> torch.Tensor:
        return self.correct / self.valid.clamp_min(1)

    @property
    def tau_est(self) -> float:
        return 1.0 + self.leading.float().mean().item()


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """(B,) loss weights: 0 for slot 0, exp(-(k-1)/gamma) for slot k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), torch.zeros(()))


def dflash_loss(logits: torch.Tensor, labels: torch.Tensor, block_size: int, gamma: float) -> LossStats:
    """Decayed block cross entropy plus accuracy statistics.

    Args:
        logits: (1, Q, V) drafter logits, Q = N * B.
        labels: (1, Q) targets, IGNORE where unsupervised (always at slot 0).
        block_size: B.
        gamma: decay; slot k has weight exp(-(k-1)/gamma).

    Returns:
        `LossStats`; `loss` is normalised by the summed weight of valid slots.
        A block's leading count stops at its first wrong or unsupervised slot.
    """
    V = logits.shape[-1]
    flat = labels.reshape(-1)
    ce = F.cross_entropy(logits.reshape(-1, V).float(), flat, ignore_index=IGNORE, reduction="none")
    valid = (flat != IGNORE).view(-1, block_size)  # (N, B)
    w = slot_weights(block_size, gamma).to(logits.device)[None, :] * valid  # (N, B)
    weighted_sum = (ce.view(-1, block_size) * w).sum()
    weight_sum = float(w.sum())
    hit = (logits.detach().argmax(-1).reshape(-1) == flat).view(-1, block_size) & valid
    leading = hit[:, 1:].int().cumprod(dim=1).sum(dim=1)  # (N,)
    return LossStats(
        loss=weighted_sum / max(weight_sum, 1e-12),
        weighted_sum=weighted_sum,
        weight_sum=weight_sum,
        correct=hit[:, 1:].sum(0).cpu().double(),
        valid=valid[:, 1:].sum(0).cpu().double(),
        leading=leading.cpu(),
    )


# ----------------------------------------------------------------------------- schedule & plan


def warmup_cosine(warmup_steps: int, total_steps: int):
    """LR multiplier: linear warmup to 1, then cosine decay to 0 at `total_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def total_steps(n_samples: int, tcfg: TrainConfig) -> int:
    """Optimizer steps: epochs * ceil(n / batch_size), capped by max_steps."""
    steps = tcfg.epochs * math.ceil(n_samples / tcfg.batch_size)
    return min(steps, tcfg.max_steps) if tcfg.max_steps else steps


def step_indices(step: int, n_samples: int, tcfg: TrainConfig) -> list[int]:
    """Sample indices of optimizer step `step`: a seeded shuffle per epoch, cut in batches."""
    per_epoch = math.ceil(n_samples / tcfg.batch_size)
    epoch, k = divmod(step, per_epoch)
    order = torch.randperm(n_samples, generator=torch.Generator().manual_seed(tcfg.seed * 100_003 + epoch))
    return order[k * tcfg.batch_size : (k + 1) * tcfg.batch_size].tolist()


def anchor_generator(seed: int, step: int, j: int) -> torch.Generator:
    """Anchor RNG of the j-th sequence in step `step` (derived, so resume needs no RNG replay)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 4096 + j)


# ----------------------------------------------------------------------------- one step


@dataclass
class _Run:
    """The live objects of one training run."""

    drafter: DFlashDrafter
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    samples: list[FeatureSample]
    tcfg: TrainConfig
    gamma: float
    total: int
    out_dir: str
    meta: dict
    device: torch.device


def _train_step(run: _Run, seqs: list[FeatureSample], step: int) -> dict[str, Any]:
    """One optimizer step over `seqs` (gradient accumulation, one sequence per forward)."""
    cfg, tcfg, B = run.drafter.config, run.tcfg, run.drafter.config.block_size
    batches = [
        build_training_batch(s, B, tcfg.num_anchors, anchor_generator(tcfg.seed, step, j), cfg.mask_token_id)
        for j, s in enumerate(seqs)
    ]
    batches = [b for b in batches if b is not None]
    weights = slot_weights(B, run.gamma)
    # Normalise by the whole step's valid weight, known before any forward pass.
    w_total = sum(float((weights * (b.labels.view(-1, B) != IGNORE)).sum()) for b in batches)
    run.opt.zero_grad(set_to_none=True)
    stats = []
    for b in batches:
        b = b.to(run.device)
        logits = run.drafter(b.block_ids, b.block_pos, b.ctx_hidden, b.ctx_pos, b.attn_mask)
        st = dflash_loss(logits, b.labels, B, run.gamma)
        if w_total > 0:
            (st.weighted_sum / w_total).backward()
        stats.append(st)
    torch.nn.utils.clip_grad_norm_([p for p in run.drafter.parameters() if p.requires_grad], tcfg.grad_clip)
    run.opt.step()  # parameters without gradients (a step with no labels) are left untouched
    run.sched.step()
    return _step_record(stats, w_total, B, skipped=len(seqs) - len(batches))


def _step_record(stats: list[LossStats], w_total: float, block_size: int, skipped: int) -> dict:
    zeros = torch.zeros(block_size - 1, dtype=torch.float64)
    return {
        "loss": sum(float(s.weighted_sum.detach()) for s in stats) / w_total if w_total > 0 else None,
        "correct": sum((s.correct for s in stats), zeros).tolist(),
        "valid": sum((s.valid for s in stats), zeros).tolist(),
        "leading": float(sum(int(s.leading.sum()) for s in stats)),
        "blocks": sum(int(s.leading.numel()) for s in stats),
        "skipped": skipped,
    }


def _run_meta(samples: list[FeatureSample], dcfg: DFlashConfig, tcfg: TrainConfig) -> dict:
    """What a checkpoint must agree with to be resumed (device and cadence may change)."""
    train = tcfg.model_dump(mode="json", exclude={"device", "checkpoint_every"})
    ids = hashlib.sha256("\n".join(_sample_ids(samples)).encode()).hexdigest()
    return {"drafter": dcfg.to_dict(), "train": train, "samples": {"count": len(samples), "ids_sha256": ids}}


# ----------------------------------------------------------------------------- the loop


def _sample_ids(samples) -> list[str]:
    # An online source (draftflow.stages.train.OnlineSamples) knows its ids without computing features.
    return list(samples.sample_ids) if hasattr(samples, "sample_ids") else [s.sample_id for s in samples]


def _take(samples, idx: list[int]) -> list[FeatureSample]:
    # An online source computes one step's features in one batched target forward.
    return samples.take(idx) if hasattr(samples, "take") else [samples[i] for i in idx]


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; anything else as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def train_drafter(
    samples: list[FeatureSample], target_model, dcfg: DFlashConfig, tcfg: TrainConfig, out_dir: str, resume: bool = True
) -> dict:
    """Train a DFlash drafter on feature samples; checkpoint and resume in `out_dir`.

    Args:
        samples: sequences with tap features in `dcfg.target_layer_ids` order: a list, or
            an online source with `__len__`, `sample_ids` and `take(indices)`.
        target_model: the HF target; only its embedding and LM head are used (frozen,
            and moved to the training device with the drafter).
        dcfg: drafter shape. tcfg: the `train` config section.
        out_dir: local folder; gets `checkpoints/`, the final drafter
            (`model.safetensors`, `config.json`, loadable by `DFlashDrafter.load`)
            and `metrics.json`.
        resume: continue from the newest checkpoint in `out_dir` when there is one.

    Returns:
        Metrics: loss (mean of the last steps), first_loss, accuracy per slot k=1..B-1,
        tau_est, steps, trainable_params, frozen_params, skipped_sequences.
    """
    if not samples:
        raise ConfigError("no training samples: the extract stage produced no features")
    device = resolve_device(tcfg.device)
    torch.manual_seed(tcfg.seed)  # drafter init
    drafter = DFlashDrafter(dcfg, target_model).to(device)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tcfg.lr, weight_decay=tcfg.weight_decay)
    total = total_steps(len(samples), tcfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(math.ceil(tcfg.warmup_ratio * total), total))
    gamma = tcfg.gamma or default_gamma(dcfg.block_size)
    run = _Run(drafter, opt, sched, samples, tcfg, gamma, total, out_dir, _run_meta(samples, dcfg, tcfg), device)
    state: dict[str, Any] = {"step": 0, "history": [], "window": [], "skipped": 0}
    ckpt = latest_checkpoint(out_dir) if resume else None
    if ckpt is not None:
        state = load_checkpoint(ckpt, drafter, opt, sched, run.meta, device)
        logger.info("resumed from %s at step %d of %d", ckpt, state["step"], total)
    _run_steps(run, state)
    drafter.save(out_dir)
    metrics = _metrics(state, drafter)
    (Path(out_dir) / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def _run_steps(run: _Run, state: dict) -> None:
    log_every = max(1, run.total // 20)
    run.drafter.train()
    while state["step"] < run.total:
        idx = step_indices(state["step"], len(run.samples), run.tcfg)
        rec = _train_step(run, _take(run.samples, idx), state["step"])
        state["step"] += 1
        state["history"].append(rec["loss"])
        state["window"] = (state["window"] + [rec])[-METRIC_WINDOW:]
        state["skipped"] += rec["skipped"]
        if state["step"] % log_every == 0 or state["step"] == run.total:
            lr = run.sched.get_last_lr()[0]
            logger.info("step %d/%d loss %s lr %.2e", state["step"], run.total, _fmt(rec["loss"]), lr)
        if state["step"] % run.tcfg.checkpoint_every == 0 or state["step"] == run.total:
            save_checkpoint(run.out_dir, run.drafter, run.opt, run.sched, state, run.meta)


def _fmt(loss: float | None) -> str:
    return "n/a" if loss is None else f"{loss:.4f}"


def _metrics(state: dict, drafter: DFlashDrafter) -> dict:
    window = state["window"]
    correct = torch.tensor([r["correct"] for r in window]).sum(0)
    valid = torch.tensor([r["valid"] for r in window]).sum(0)
    losses = [r["loss"] for r in window if r["loss"] is not None]
    trainable, frozen = drafter.param_counts()
    return {
        "loss": sum(losses) / len(losses) if losses else None,
        "first_loss": next((x for x in state["history"] if x is not None), None),
        "accuracy": (correct / valid.clamp_min(1)).tolist(),
        "tau_est": 1.0 + sum(r["leading"] for r in window) / max(1, sum(r["blocks"] for r in window)),
        "steps": state["step"],
        "trainable_params": trainable,
        "frozen_params": frozen,
        "skipped_sequences": state["skipped"],
    }
