"""Feature shards: the target's hidden states at the drafter's taps.

One safetensors file holds many samples, packed along the token axis:

    hidden_states  (T_total, n_taps, D)  bf16 (or fp32)   tap i = layer_ids[i]
    input_ids      (T_total,)            int64
    loss_mask      (T_total,)            uint8            1 = supervised
    offsets        (n_samples + 1,)      int64            sample j = [offsets[j], offsets[j+1])

Metadata (strings): `format`, `layer_ids` (JSON list, DFlash ids, see
`draftflow.layers`), `sample_ids` (JSON list, in offset order).
Reads are memory-mapped (`safe_open`), so a shard is never loaded whole to
get one sample. This module knows nothing of models or engines.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftflow.errors import StoreError

FORMAT = "draftflow.features.v1"


@dataclass
class FeatureSample:
    sample_id: str
    input_ids: torch.Tensor  # (T,) int64
    loss_mask: torch.Tensor  # (T,) bool
    hidden: torch.Tensor  # (T, n_taps, D)


def write_feature_shard(path: str | Path, samples: list[FeatureSample], layer_ids: list[int]) -> int:
    """Pack samples into one safetensors file at `path` (a local path); return tokens written."""
    if not samples:
        raise ValueError("a feature shard needs at least one sample")
    lengths = [int(s.input_ids.numel()) for s in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    tensors = {
        "hidden_states": torch.cat([s.hidden for s in samples]).contiguous(),
        "input_ids": torch.cat([s.input_ids.to(torch.int64) for s in samples]).contiguous(),
        "loss_mask": torch.cat([s.loss_mask.to(torch.uint8) for s in samples]).contiguous(),
        "offsets": offsets,
    }
    meta = {
        "format": FORMAT,
        "layer_ids": json.dumps(list(layer_ids)),
        "sample_ids": json.dumps([s.sample_id for s in samples]),
    }
    save_file(tensors, str(path), metadata=meta)
    return int(offsets[-1])


class FeatureShard:
    """Memory-mapped random access to one feature shard (a local file)."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        try:
            self._f = safe_open(self.path, framework="pt")
        except Exception as exc:  # safetensors raises its own error types
            raise StoreError(f"feature shard {self.path} is unreadable ({exc}); delete it to recompute") from None
        meta = self._f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise StoreError(f"feature shard {self.path} has format {meta.get('format')!r}, expected {FORMAT}")
        self.layer_ids: list[int] = json.loads(meta["layer_ids"])
        self.sample_ids: list[str] = json.loads(meta["sample_ids"])
        self.offsets = self._f.get_tensor("offsets")
        self._index = {sid: i for i, sid in enumerate(self.sample_ids)}

    def __len__(self) -> int:
        return len(self.sample_ids)

    def get(self, key: int | str) -> FeatureSample:
        """One sample by position or by sample id."""
        i = self._index[key] if isinstance(key, str) else key
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return FeatureSample(
            sample_id=self.sample_ids[i],
            input_ids=self._f.get_slice("input_ids")[lo:hi],
            loss_mask=self._f.get_slice("loss_mask")[lo:hi].bool(),
            hidden=self._f.get_slice("hidden_states")[lo:hi],
        )

    def __iter__(self) -> Iterator[FeatureSample]:
        for i in range(len(self)):
            yield self.get(i)


def load_samples(paths: list[str | Path]) -> list[FeatureSample]:
    """Every sample of the given local shards, in order."""
    return [s for p in paths for s in FeatureShard(p)]
