"""Training samples read on demand from feature shards: what the trainer iterates over.

`FeatureSource` holds only the shards' indexes (sample ids, offsets); `take(indices)` reads
the samples of one step, each as a few large reads (one per stored tensor range, see
`draftflow.features`). Nothing is loaded up front, so a rank holds one step of features, not
the dataset, and under torchrun each rank reads only the samples of its share of each step.

This module knows nothing of models or of the training loop beyond the source protocol the
loop consumes (`__len__`, `sample_ids`, `lengths`, `take`).
"""

from __future__ import annotations

from collections.abc import Sequence

from draftflow.features import FeatureSample, FeatureShard


class FeatureSource:
    """The samples of several feature shards, in shard order, read when taken.

    Args:
        shards: open shards (their headers are read; no sample is).

    Trade-off: `take` reads in the order asked (the trainer's shuffle), one sample at a time;
    each sample is a few large contiguous reads, which the disk serves near sequential speed,
    while a whole-shard read would load what this rank may never train on.
    """

    def __init__(self, shards: Sequence[FeatureShard]):
        self.shards = list(shards)
        self._where = [(k, i) for k, s in enumerate(self.shards) for i in range(len(s))]
        self.sample_ids = [sid for s in self.shards for sid in s.sample_ids]
        self.lengths = [int(n) for s in self.shards for n in (s.offsets[1:] - s.offsets[:-1]).tolist()]
        self.tokens = sum(self.lengths)

    def __len__(self) -> int:
        return len(self._where)

    def __getitem__(self, i: int) -> FeatureSample:
        return self.take([i])[0]

    def take(self, indices: Sequence[int]) -> list[FeatureSample]:
        """The samples at global positions `indices` (shard order), read now."""
        return [self._read(*self._where[i]) for i in indices]

    def _read(self, k: int, i: int) -> FeatureSample:
        return self.shards[k].get(i)


def local_source(paths: Sequence[str]) -> FeatureSource:
    """A source over local shard files (already verified by the caller)."""
    return FeatureSource([FeatureShard(p) for p in paths])
