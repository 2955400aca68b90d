"""One training run from the train stage's inputs: the target, the drafter config, the samples; then the loop.

`train_here` is what the train stage runs in its own process and what every torchrun rank runs
(`draftflow.training.launch`): each rank loads the target and its samples itself, so this module,
not the stage, is the rank's entry into training. It reads the stage's inputs as the stage passes
them (the extract manifest, or tokenize rows in online mode; EAGLE-3's token counts), verified
through the store, and copies checkpoints to the store on remote roots (`draftflow.training.mirror`).

What it does not know: Prefect, where the run's outputs are committed (the stage does that, with
the manifest, after training), torchrun (`draftflow.training.launch`). Trade-off: ranks resolve
their inputs themselves (each checksum-verifies what it reads) rather than receive resolved
paths, so one function serves both the in-process path and every rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from draftflow.config import RunConfig
from draftflow.contracts import FeatureSource, OnlineFeatures, ShardEntry
from draftflow.drafters.registry import DraftInputs, drafter_spec
from draftflow.drafters.taps import check_drafter
from draftflow.errors import ConfigError
from draftflow.feature_stream import open_features
from draftflow.features import STORED, FeatureSample, round_trip
from draftflow.store import Store
from draftflow.target import TargetRef, load_target
from draftflow.training.mirror import push_checkpoint

log = logging.getLogger(__name__)


def mask_token_id(tokenizer, embedding_rows: int | None = None) -> int:
    """The tokenizer's mask token, else `len(tokenizer)` (DFlash; Qwen3 gives 151669) when the target's
    embedding has that row, else the highest added token that is not one of the tokenizer's special
    tokens (SmolLM2, whose 49,152 rows are all tokens: 16, `<empty_output>`). Such a token never occurs
    in chat text the template renders; its (frozen) embedding is only a marker for the masked slots.

    Raises:
        ConfigError: no spare row and no unused added token; the message says to set drafter.mask_token_id.
    """
    if tokenizer.mask_token_id is not None:
        return tokenizer.mask_token_id
    if embedding_rows is None or len(tokenizer) < embedding_rows:
        return len(tokenizer)
    used = set(tokenizer.all_special_ids)
    spare = [i for i in tokenizer.added_tokens_decoder if i not in used and i < embedding_rows]
    if not spare:
        raise ConfigError(f"the target has no spare embedding row for the DFlash mask token (len(tokenizer) = "
                          f"{len(tokenizer)} = embedding rows) and no unused added token; set drafter.mask_token_id "
                          "to an id its chat never uses")
    log.info("mask token: id %d (%s), an added token the chat does not use (the embedding has no spare row)",
             max(spare), tokenizer.convert_ids_to_tokens(max(spare)))
    return max(spare)


def check_taps(dcfg: Any, shards: tuple[ShardEntry, ...]) -> None:
    """The drafter's taps (EAGLE-3: and the final state, id -1) must be the ones the features were extracted at."""
    for s in shards:
        if list(s.layer_ids or ()) != dcfg.feature_ids:
            raise ConfigError(
                f"feature shard {s.name} holds taps {list(s.layer_ids or ())} but the drafter wants "
                f"{dcfg.feature_ids}; re-run extract with the same drafter.kind and drafter.target_layer_ids"
            )


def token_counts(store: Store, features: FeatureSource) -> str:
    """Local, checksum-verified path of the token counts (tokenize's `token_freq.parquet`) handed on with the features.

    Raises:
        ConfigError: no stage before train handed token counts on.
    """
    ref = features.token_counts
    if ref is None:
        raise ConfigError("this drafter's draft vocabulary needs the token counts tokenize writes "
                          "(token_freq.parquet), but the features were handed none; re-run tokenize and extract")
    return store.verify_sha(ref.stage, ref.fingerprint, ref.entry)


def draft_vocab(store: Store, features: FeatureSource, choose, size: int,
                vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d): the kind's draft vocabulary (`choose`: `DrafterSpec.draft_vocab`) of `size` tokens from the
    supervised tokens counted by tokenize, for a target vocabulary of `vocab_size`. Chosen here, not in
    tokenize, so `drafter.draft_vocab_size` is a train setting: changing it re-runs training only, never extract."""
    from collections import Counter

    from draftflow.data.schema import read_rows

    counts = Counter({r["token_id"]: r["count"] for r in read_rows(token_counts(store, features))})
    d2t, t2d = choose(counts, vocab_size, size)
    return torch.tensor(d2t, dtype=torch.int64), torch.tensor(t2d, dtype=torch.bool)


def warm_start(cfg: RunConfig, model) -> Any:
    """`train.init_from`'s drafter, loaded around the target (`draftflow.training.warm`), or None."""
    if not cfg.train.init_from:
        return None
    from draftflow.training import warm

    init = warm.resolve(cfg.root, cfg.train.init_from)
    log.info("warm start from %s (%s)", init.folder, init.digest[:12])
    return init, warm.load(init, model)


def drafter_config(store: Store, cfg: RunConfig, model, tokenizer, features: FeatureSource, init: Any = None):
    """(the drafter config of `drafter.kind`, the draft vocabulary (d2t, t2d) for kinds that choose one else None).

    A warm start (`init`: `warm_start`'s) keeps its drafter's draft vocabulary: its head is trained over that one."""
    check_drafter(cfg.drafter)
    spec = drafter_spec(cfg.drafter.kind)
    vocab = None
    if spec.draft_vocab and init is not None and hasattr(init[1], "d2t"):
        vocab = (init[1].d2t.detach().clone(), init[1].t2d.detach().clone())
    elif spec.draft_vocab:
        vocab = draft_vocab(store, features, spec.draft_vocab, cfg.drafter.draft_vocab_size, model.config.vocab_size)
    rows = model.get_input_embeddings().num_embeddings
    mask = mask_token_id(tokenizer, rows) if spec.mask_token and cfg.drafter.mask_token_id is None else None
    inputs = DraftInputs(mask_token_id=mask,
                         draft_vocab_size=None if vocab is None else vocab[0].numel())
    return spec.config_from_target(model.config, cfg.drafter, inputs), vocab


def loss_tokens(store: Store, cfg: RunConfig, features: FeatureSource,
                draft: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor | None:
    """`train.sampled_softmax`: the ids always scored, every token tokenize counted as supervised, in the head's own
    ids (the draft vocabulary's, `draft` = (d2t, t2d), for a kind that has one), else None."""
    if not cfg.train.sampled_softmax:
        return None
    from draftflow.data.schema import read_rows

    ids = torch.tensor(sorted(r["token_id"] for r in read_rows(token_counts(store, features))), dtype=torch.int64)
    if draft is None:
        return ids
    from draftflow.drafters.eagle3.vocab import draft_ids

    return draft_ids(ids, draft[1])


@dataclass
class Trained:
    """What the stage needs from a finished training run."""

    metrics: dict[str, Any]
    target_config: Any  # the target's HF config, as loaded for training (exports read it)
    rows: int  # training sequences
    tokens: int  # their tokens


def train_here(store: Store, cfg: RunConfig, target: TargetRef, features: FeatureSource, out: str,
               mirror: str | None = None) -> Trained:
    """Load the target, the drafter config and the samples, and train in this process.

    The in-process path, and what each torchrun rank runs (`draftflow.training.launch`). With
    `mirror` (remote roots), every checkpoint is also copied there (`push_checkpoint`).
    """
    from draftflow.training.loop import Hooks, Start, train_drafter

    model, tokenizer = load_target(target.path, cfg.target.dtype, cfg.target.device)
    init = warm_start(cfg, model)
    dcfg, vocab = drafter_config(store, cfg, model, tokenizer, features, init)
    samples, tokens = training_samples(store, cfg, target, dcfg, features)
    push = (lambda folder: push_checkpoint(store, mirror, folder)) if mirror else None
    hooks = Hooks(on_checkpoint=push, on_heldout=publish_heldout)
    start = Start(vocab, loss_tokens(store, cfg, features, vocab), init, cfg.drafter)
    metrics = train_drafter(samples, model, dcfg, cfg.train, out, start=start, hooks=hooks)
    return Trained(metrics, model.config, len(samples), tokens)


def publish_heldout(history: list[dict]) -> None:
    """The held-out history so far, to whoever listens (the Prefect UI: a markdown artifact, new each time)."""
    from draftflow import progress
    from draftflow.training.heldout import markdown

    progress.document("train", "heldout", markdown(history))


def training_samples(store: Store, cfg: RunConfig, target: TargetRef, dcfg: Any,
                     features: FeatureSource) -> tuple[Any, int]:
    """(samples, their tokens): stored feature shards, or an `OnlineSamples` source in online mode."""
    if isinstance(features, OnlineFeatures):
        paths = [store.verify_sha(features.stage, features.fingerprint, s) for s in features.shards]
        samples = OnlineSamples.from_parquet(paths, target, cfg, dcfg.feature_ids)
        return samples, samples.tokens
    check_taps(dcfg, features.shards)
    source = open_features(store, features.stage, features.fingerprint, features.shards)  # streamed on remote roots
    return source, source.tokens  # read per step, by the ranks that train on them


class OnlineSamples:
    """Training sequences whose features are computed per step by the co-located target.

    Holds the tokenize rows as Arrow columns (ids and masks, no features). `take`
    runs extract's capture engine over one step's sequences and rounds the result
    through the storage format, so it returns what `FeatureShard.get` would.
    """

    def __init__(self, table: pa.Table, engine, dtype: str, batch_size: int):
        self.table, self.engine, self.dtype, self.batch_size = table, engine, dtype, batch_size
        self.sample_ids = [f"{s}:{r}" for s, r in zip(table["sample_id"].to_pylist(), table["row"].to_pylist())]
        self.tokens = int(pc.sum(pc.list_value_length(table["input_ids"])).as_py() or 0)

    @classmethod
    def from_parquet(cls, paths: list[str], target: TargetRef, cfg: RunConfig, layer_ids: list[int]) -> OnlineSamples:
        from draftflow.engines.capture import make_capture_engine

        cols = ["sample_id", "row", "input_ids", "loss_mask"]
        table = pa.concat_tables([pq.read_table(p, columns=cols) for p in paths])
        engine = make_capture_engine("hf", target.path, list(layer_ids), cfg.target.dtype, cfg.target.device)
        return cls(table, engine, cfg.extract.dtype, cfg.extract.batch_size)

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, i: int) -> FeatureSample:
        return self.take([i])[0]

    def take(self, indices: list[int]) -> list[FeatureSample]:
        """The samples at `indices`, features captured in length-sorted batches of `extract.batch_size`."""
        from draftflow.engines.capture import capture_in_batches

        rows = self.table.take(pa.array(indices, type=pa.int64())).to_pylist()
        feats, self.batch_size = capture_in_batches(self.engine, [r["input_ids"] for r in rows], self.batch_size)
        return [FeatureSample(self.sample_ids[i], torch.tensor(r["input_ids"], dtype=torch.int64),
                              torch.tensor(r["loss_mask"], dtype=torch.bool), as_stored(f, self.dtype))
                for i, r, f in zip(indices, rows, feats)]


def as_stored(feats: torch.Tensor, dtype: str) -> torch.Tensor:
    """(T, n_taps, D) features as a reader of an `extract.dtype` shard gets them (fp8: dequantized bf16)."""
    reader = torch.bfloat16 if dtype == "float8" else STORED[dtype]
    return round_trip(feats, dtype, feats.shape[1]).to(reader)
