"""Extract: the target's hidden states at the drafter's taps, packed in feature shards.

Tap ids follow DFlash semantics (`draftflow.layers`): id L is the output of
decoder layer L, `hidden_states[L + 1]`. Samples are run in length-sorted
batches with right padding (padding never changes the valid positions of a
causal model) and stored bf16 by default, many per safetensors shard.
This first version asks transformers for every layer's output and keeps the
taps; capturing only the taps with hooks is the memory optimisation for big targets.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from draftflow.config import RunConfig
from draftflow.data.schema import read_rows
from draftflow.features import FeatureSample, write_feature_shard
from draftflow.layers import default_dflash_layer_ids, hf_hidden_state_index, validate_layer_ids
from draftflow.stages.common import shard_result
from draftflow.store import Store, shard_entry
from draftflow.target import TargetRef, load_target, model_lock

log = logging.getLogger(__name__)
STAGE = "extract"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def drafter_layer_ids(cfg: RunConfig, num_target_layers: int) -> list[int]:
    """The configured taps, or the paper's default, validated against the target depth."""
    ids = cfg.drafter.target_layer_ids
    if ids is None:
        ids = default_dflash_layer_ids(num_target_layers, cfg.drafter.num_taps)
    return validate_layer_ids(ids, num_target_layers)


@torch.no_grad()
def capture(model, batch_ids: list[list[int]], layer_ids: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """Tap features per sequence: a list of (T_i, n_taps, D) tensors."""
    width = max(len(x) for x in batch_ids)
    ids = torch.zeros((len(batch_ids), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, x in enumerate(batch_ids):
        ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = 1
    with model_lock(model):
        out = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), output_hidden_states=True)
    taps = torch.stack([out.hidden_states[hf_hidden_state_index(L)] for L in layer_ids], dim=2)  # (B, T, n, D)
    return [taps[i, : len(x)].to("cpu", dtype) for i, x in enumerate(batch_ids)]


def run_shard(store: Store, fp: str, cfg: RunConfig, target: TargetRef, tok_fp: str,
              shard: dict[str, Any]) -> dict[str, Any]:
    """Extract features for one tokenize shard into one safetensors feature shard."""
    model, _ = load_target(target.path, cfg.target.dtype, cfg.target.device)
    layer_ids = drafter_layer_ids(cfg, model.config.num_hidden_layers)
    rows = read_rows(store.verify_sha("tokenize", tok_fp, shard))
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))
    samples: dict[int, FeatureSample] = {}
    for lo in range(0, len(order), cfg.extract.batch_size):
        idx = order[lo:lo + cfg.extract.batch_size]
        feats = capture(model, [rows[i]["input_ids"] for i in idx], layer_ids, DTYPES[cfg.extract.dtype])
        for i, f in zip(idx, feats):
            r = rows[i]
            samples[i] = FeatureSample(f"{r['sample_id']}:{r['row']}", torch.tensor(r["input_ids"]),
                                       torch.tensor(r["loss_mask"], dtype=torch.bool), f)
    name = shard["name"].replace(".parquet", ".safetensors")
    with store.writing(store.stage_path(STAGE, fp, name)) as tmp:
        tokens = write_feature_shard(tmp, [samples[i] for i in range(len(rows))], layer_ids)
        entry = shard_entry(name, tmp, rows=len(rows), tokens=tokens, split=shard["split"], layer_ids=layer_ids)
    log.info("extracted %s: %d sequences, %d tokens, taps %s", name, len(rows), tokens, layer_ids)
    return shard_result(entry, None, len(rows), len(rows), {})
