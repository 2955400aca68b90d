"""Sizes and times of the stages before they run: what `draftflow plan` prints.

Sizes come from a stage's own manifest when it is complete ("measured"), else from its
upstream's size and the config ("estimated", upper bounds): source row counts (parquet
metadata; JSONL lines in the first MiB scaled by file size) capped by `count`/`total_rows`;
one assistant turn per conversation, answers of `max_new_tokens`, prompts of bytes-per-row / 4
tokens, rows cut at `max_length`. Times are a throughput model (`stage_seconds`,
`assumptions`): FLOPs or weight reads divided by assumed shares of the device's peak.

Does not know: stores or fingerprints (`draftflow.runs.plan` walks the stages); it never loads
weights (the target's shape comes from its config.json).
"""

from __future__ import annotations

import os
from typing import Any

from draftflow.compat import importing_transformers
from draftflow.config import RunConfig
from draftflow.drafters.registry import DRAFTERS, drafter_spec
from draftflow.drafters.taps import feature_ids
from draftflow.errors import ConfigError
from draftflow.target import TargetRef

# Bytes per stored feature element, and what is stored per token beside the features.
DTYPE_BYTES = {"bfloat16": 2, "float32": 4, "float8": 1}
FP8_SCALE_BYTES = 4  # float8: one fp32 scale per token and tap
TOKEN_OVERHEAD_BYTES = 9  # int64 input id + uint8 loss-mask byte per token


def target_config(cfg: RunConfig, target: TargetRef):
    """The target's transformers config (config.json only; no weights are read)."""
    with importing_transformers():
        from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(target.path, revision=cfg.target.revision)
    except (OSError, ValueError, KeyError) as exc:  # missing, not JSON, or no known model_type
        raise ConfigError(f"cannot load the target config from {target.path}: {exc}".splitlines()[0]) from None



def feature_bytes_per_token(cfg: RunConfig, n_taps: int, hidden: int) -> int:
    """Stored bytes per token: taps x hidden x dtype size (+ fp8 scales) + id and mask."""
    per = n_taps * hidden * DTYPE_BYTES[cfg.extract.dtype]
    if cfg.extract.dtype == "float8":
        per += n_taps * FP8_SCALE_BYTES
    return per + TOKEN_OVERHEAD_BYTES


def feature_bytes(cfg: RunConfig, tokens: int, n_taps: int, hidden: int) -> int:
    """Bytes the extract stage writes for `tokens` tokens (0 in online mode: nothing is stored)."""
    return 0 if cfg.extract.mode == "online" else tokens * feature_bytes_per_token(cfg, n_taps, hidden)


# ----------------------------------------------------------------------------- sizes

CHARS_PER_TOKEN = 4  # source bytes per row / 4 ~ prompt tokens (BPE on English text)
HEAD_BYTES = 1 << 20  # JSONL lines are counted in this much of a file, then scaled by its size
ASSUMED_COMPRESSION = 4.0  # a compressed JSONL file is taken to hold 4x its size of text


def _file_rows(path: str) -> tuple[int, int]:
    """(rows, uncompressed bytes) of one source file: exact for parquet, scaled for JSONL."""
    import fsspec
    import pyarrow.parquet as pq

    from draftflow.data.readers import _open_lines

    fs, p = fsspec.core.url_to_fs(path)
    if path.endswith(".parquet"):
        with fs.open(p, "rb") as fh:
            meta = pq.ParquetFile(fh).metadata
        return meta.num_rows, sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    with _open_lines(path) as fh:
        head, more = fh.read(HEAD_BYTES), bool(fh.read(1))
    lines = head.count(b"\n") + (1 if head and not head.endswith(b"\n") else 0)
    if not more:
        return lines, len(head)
    compressed = path.endswith((".gz", ".zst", ".bz2", ".xz"))
    total = (fs.size(p) or 0) * (ASSUMED_COMPRESSION if compressed else 1.0)
    return int(lines * total / max(1, len(head))), int(total)


def source_estimate(cfg: RunConfig) -> tuple[int | None, float]:
    """(rows curate reads at most, bytes per row) from the sources, after `count` and `total_rows`.

    An `hf:` source without `count` has no known size: rows is then None.
    """
    from draftflow.data.readers import source_files

    rows, nbytes = 0, 0.0
    for src in cfg.curate.sources:
        found = [_file_rows(f) for f in source_files(src)]
        n, b = sum(r for r, _ in found), float(sum(b for _, b in found))
        if src.hf is not None and src.count is None:
            return None, 0.0
        if src.count is not None and n:
            b *= min(1.0, src.count / n)
        rows, nbytes = rows + (src.count if src.hf is not None else min(n, src.count or n)), nbytes + b
    if cfg.curate.total_rows:
        rows = min(rows, cfg.curate.total_rows)
    return rows, nbytes / max(1, rows)


# Size models, one per stage (`StageSpec.size`): (cfg, upstream size or None, sizes so far, ctx) -> size.


def curate_size(cfg: RunConfig, up: dict | None, sizes: dict, ctx: dict) -> dict[str, Any]:
    rows = ctx["source_rows"]
    if rows is None:
        return {"basis": "unknown"}
    n_eval = int(rows * cfg.curate.eval_fraction)
    return {"rows": rows, "train_rows": rows - n_eval, "eval_rows": n_eval, "tokens": None}


def regenerate_size(cfg: RunConfig, up: dict, sizes: dict, ctx: dict) -> dict[str, Any]:
    rows = up["train_rows"]
    return {"rows": rows, "tokens": rows * cfg.regenerate.max_new_tokens}


def tokenize_size(cfg: RunConfig, up: dict, sizes: dict, ctx: dict) -> dict[str, Any]:
    per = min(cfg.tokenize.max_length, ctx["prompt_tokens"] + up["tokens"] / max(1, up["rows"]))
    return {"rows": up["rows"], "train_rows": up["rows"], "tokens": int(up["rows"] * per),
            "train_tokens": int(up["rows"] * per)}


def extract_size(cfg: RunConfig, up: dict, sizes: dict, ctx: dict) -> dict[str, Any]:
    tokens = up["train_tokens"]
    return {"rows": up["train_rows"], "tokens": tokens, "bytes": feature_bytes(cfg, tokens, ctx["taps"], ctx["hidden"])}


def train_size(cfg: RunConfig, up: dict, sizes: dict, ctx: dict) -> dict[str, Any]:
    passes = _passes(cfg, up["rows"])
    return {"rows": up["rows"], "tokens": int(up["tokens"] * passes), "passes": passes,
            "bytes": train_bytes(cfg, ctx)}


KEPT_CHECKPOINTS = 2  # training.checkpoint.KEEP_CHECKPOINTS (not imported: plan stays free of torch)


def train_bytes(cfg: RunConfig, ctx: dict) -> int:
    """What train writes at its peak: its checkpoints (float32 weights + Adam's two moments; the kept ones, one
    being written and the final one) and two float32 exports, for a drafter of `drafter.num_layers` target-
    shaped layers plus the fc that fuses the taps (the frozen embedding and head are not saved)."""
    return int(drafter_params(cfg.drafter.num_layers, ctx) * 4 * (3 * (KEPT_CHECKPOINTS + 2) + 2))


def drafter_params(num_layers: int, ctx: dict) -> int:
    """Trainable parameters of a drafter of `num_layers` target-shaped layers and a taps x hidden fc (norms,
    a fraction of a percent, left out)."""
    return num_layers * ctx["layer_params"] + ctx["taps"] * ctx["hidden"] ** 2


def evaluate_size(cfg: RunConfig, up: dict, sizes: dict, ctx: dict) -> dict[str, Any]:
    prompts = cfg.evaluate.num_prompts or sizes["curate"].get("eval_rows") or 0
    return {"rows": prompts, "tokens": prompts * cfg.evaluate.max_new_tokens}


def _passes(cfg: RunConfig, rows: int) -> float:
    """Epochs over the data the train stage makes (max_steps may stop it earlier)."""
    if cfg.train.max_steps is None or rows == 0:
        return float(cfg.train.epochs)
    return min(float(cfg.train.epochs), cfg.train.max_steps * cfg.train.batch_size / rows)


# ----------------------------------------------------------------------------- time

# Peak dense TFLOP/s (bf16; fp32 for cpu) and memory GB/s; matched against the CUDA device name.
HARDWARE = {"H200": (989.0, 4800.0), "H100": (989.0, 3350.0), "A100": (312.0, 2039.0), "L40S": (362.0, 864.0),
            "A10": (125.0, 600.0), "L4": (121.0, 300.0), "gpu": (312.0, 2039.0), "cpu": (0.1, 20.0)}
MFU_FORWARD, MFU_TRAIN, DECODE_BW = 0.4, 0.3, 0.6  # shares of peak reached (forward, training, decode bandwidth)
CPU_ROWS_PER_S = {"curate": 5000.0, "tokenize": 300.0}  # per core
VLLM_BATCH = 256  # sequences a continuous-batching engine decodes at once


def hardware(device: str) -> tuple[str, float, float]:
    """(name, TFLOP/s, GB/s) for a configured device; DRAFTFLOW_PLAN_HARDWARE (e.g. H100) overrides."""
    name = os.environ.get("DRAFTFLOW_PLAN_HARDWARE")
    if name is None and device != "cpu":
        import torch

        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else (
            "cpu" if device == "auto" else "gpu (no CUDA here)")
    name = name or "cpu"
    key = next((k for k in HARDWARE if k.lower() in name.lower()), "gpu")
    return name, *HARDWARE[key]


def model_shape(cfg: RunConfig, target: TargetRef) -> dict[str, Any]:
    """Target FLOPs per token, weight bytes, taps and widths, from config.json only."""
    tc = target_config(cfg, target)
    D, heads = tc.hidden_size, tc.num_attention_heads
    hd = getattr(tc, "head_dim", None) or D // heads
    layer = D * hd * 2 * (heads + getattr(tc, "num_key_value_heads", heads)) + 3 * D * tc.intermediate_size
    head = tc.vocab_size * D
    params = tc.num_hidden_layers * layer + head * (1 if getattr(tc, "tie_word_embeddings", False) else 2)
    return {"hidden": D, "taps": len(feature_ids(cfg.drafter, tc.num_hidden_layers)), "layer_params": layer,
            "head_params": head, "flops_per_token": 2 * (tc.num_hidden_layers * layer + head), "params": params}


def _param_bytes(cfg: RunConfig, hw_name: str) -> int:
    if cfg.target.dtype == "float32" or (cfg.target.dtype == "auto" and hw_name == "cpu"):
        return 4
    return 2


# Time models, one per stage (`StageSpec.seconds`): (cfg, size, model shape, prompt tokens) -> seconds or None.


def curate_seconds(cfg: RunConfig, size: dict, shape: dict, prompt_tokens: float) -> float:
    return size["rows"] / (CPU_ROWS_PER_S["curate"] * (os.cpu_count() or 1))


def tokenize_seconds(cfg: RunConfig, size: dict, shape: dict, prompt_tokens: float) -> float:
    return size["rows"] / (CPU_ROWS_PER_S["tokenize"] * (os.cpu_count() or 1))


def _rates(cfg: RunConfig, device: str, shape: dict) -> tuple[float, float, float]:
    """(peak FLOP/s, forward FLOP/s, decode tokens/s of one sequence) of `device` for the target."""
    name, tflops, gbs = hardware(device)
    flops = tflops * 1e12
    return flops, flops * MFU_FORWARD, DECODE_BW * gbs * 1e9 / (shape["params"] * _param_bytes(cfg, name))


def regenerate_seconds(cfg: RunConfig, size: dict, shape: dict, prompt_tokens: float) -> float | None:
    if cfg.regenerate.engine == "openai":
        return None  # an endpoint's speed is not known here
    _, forward, decode_tps = _rates(cfg, cfg.target.device, shape)
    batch = VLLM_BATCH if cfg.regenerate.engine == "vllm" else cfg.regenerate.batch_size
    prefill = size["rows"] * prompt_tokens * shape["flops_per_token"] / forward
    return prefill + size["tokens"] / min(batch * decode_tps, forward / shape["flops_per_token"])


def extract_seconds(cfg: RunConfig, size: dict, shape: dict, prompt_tokens: float) -> float:
    _, forward, _ = _rates(cfg, cfg.target.device, shape)
    return 0.0 if cfg.extract.mode == "online" else size["tokens"] * shape["flops_per_token"] / forward


def train_seconds(cfg: RunConfig, size: dict, shape: dict, prompt_tokens: float) -> float:
    flops, _, _ = _rates(cfg, cfg.train.device, shape)
    return _train_flops(cfg, size, shape) / (flops * MFU_TRAIN)


def evaluate_seconds(cfg: RunConfig, size: dict, shape: dict, prompt_tokens: float) -> float:
    _, _, decode_tps = _rates(cfg, cfg.evaluate.device, shape)
    return 2 * size["tokens"] / decode_tps  # baseline + speculative decoding, batch 1, tau = 1


def _train_flops(cfg: RunConfig, size: dict, shape: dict) -> float:
    """The drafter kind's cost model (`DrafterSpec.train_flops`) per sequence seen
    (+ the target's forward per sequence in online mode)."""
    seqs = size["rows"] * size.get("passes", _passes(cfg, size["rows"]))
    T = size["tokens"] / max(1.0, seqs)  # mean sequence length
    per = drafter_spec(cfg.drafter.kind).train_flops(cfg, T, shape)
    if cfg.extract.mode == "online":
        per += shape["flops_per_token"] * T
    return per * seqs


def assumptions() -> list[str]:
    """The time model in words (printed by `draftflow plan`)."""
    hw = ", ".join(f"{k} {t:g} TFLOP/s {b:g} GB/s" for k, (t, b) in HARDWARE.items())
    return [
        f"hardware peaks: {hw}; DRAFTFLOW_PLAN_HARDWARE=<name> plans for another device",
        f"curate {CPU_ROWS_PER_S['curate']:g} and tokenize {CPU_ROWS_PER_S['tokenize']:g} rows/s per core",
        f"forward passes (prefill, extract) at {MFU_FORWARD:.0%} of peak FLOP/s: 2 x params FLOPs per token",
        f"decoding at {DECODE_BW:.0%} of memory bandwidth per weight read, x batch (vllm: {VLLM_BATCH}), "
        "capped by compute; openai endpoints: unknown",
        f"training at {MFU_TRAIN:.0%} of peak, FLOPs per sequence by drafter kind: "
        + "; ".join(s.cost_note for s in DRAFTERS.values()) + " (+ the target's forward when extract.mode=online)",
        "evaluate: baseline and speculative decoding at batch 1, each token a full weight read (tau = 1)",
        f"sizes without a manifest are upper bounds: source rows before filters, prompt = bytes/row / "
        f"{CHARS_PER_TOKEN}, every answer max_new_tokens long, one sequence per conversation",
    ]
