"""The contracts between stages, typed: a shard's manifest entry, a shard task's result, a stage's
manifest, a stage flow's result, and where training finds its features.

Code passes these frozen models, never dicts: a shard function returns a `ShardResult`, `finalize`
builds a `Manifest` from them, `Store.read_manifest` returns one, a stage flow returns a
`StageResult` holding it, and train reads its features through a `FeatureSource`. Each is validated
where it is made, so a wrong count or a missing field fails at the stage that produced it.

On disk a manifest is the readable JSON it always was (`Manifest.to_json`: fields that are unset are
left out) plus a `version`. Versions: a manifest without `version` was written before versions
existed and has the same fields (version 1): it is read as such. A manifest of a newer version than
this code knows is refused in one line (`ManifestError`), never overwritten; one that is not a
manifest at all is treated as absent, so the stage is recomputed (contract 8).

Paths: a manifest names files relative to its stage folder (`ShardEntry.name`, the train stage's
`extra.checkpoint` and exports), never by an absolute path or URL, so a resumed run's manifest equals
an uninterrupted one's byte for byte and a run root can be moved or copied (`Store.stage_path` resolves them).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from draftflow.errors import StoreError

log = logging.getLogger(__name__)
MANIFEST_VERSION = 3  # 3: paths in `extra` relative to the stage folder; 2: `version` recorded; 1: no version


class ManifestError(StoreError):
    """A manifest this version of draftflow must not read (written by a newer one)."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ShardEntry(BaseModel):
    """One committed file of a stage (`store.shard_entry` makes it from the file just written).

    The optional fields are what particular stages record; a file of another kind may carry more
    (extra fields are kept, typed as JSON values).
    """

    model_config = ConfigDict(frozen=True, extra="allow")
    name: str = Field(min_length=1)
    rows: int = Field(ge=0)
    tokens: int = Field(0, ge=0)
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    split: Literal["train", "eval"] | None = None  # curate, regenerate, tokenize, extract: the data split
    kind: str | None = None  # tokenize: "freq" for the token counts
    layer_ids: tuple[int, ...] | None = None  # extract: the taps stored (decoder layer outputs)
    dtype: str | None = None  # extract: the storage format of the features
    sequences: int | None = Field(None, ge=0)  # tokenize: rows (sequences) the shard's conversations became
    supervised_tokens: int | None = Field(None, ge=0)  # tokenize: tokens under the loss mask

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)


class SourcePart(_Frozen):
    """One scan unit of the curate stage: contiguous files of one source (`stages.curate.plan_parts`).
    `sha256` stands for its content (the source's settings and its files' keys), never a path or a time."""

    name: str
    source: str
    files: tuple[str, ...]
    bytes: int = Field(ge=0)
    sha256: str


def _check_accounting(rows_in: int, rows_out: int, dropped: dict[str, int], what: str) -> None:
    lost = rows_in - rows_out - sum(dropped.values())
    if lost:
        raise ValueError(f"{what}: {lost} rows unaccounted for (rows_in={rows_in}, rows_out={rows_out}, "
                         f"dropped={dropped})")


class ShardResult(_Frozen):
    """What a shard task returns: its output and reject shards, and its accounting (contract 4).

    `info` holds a stage's own per-shard figures that its `finish` sums (regenerate's finish reasons,
    tokenize's token-count shard and sequence drops).
    """

    shard: ShardEntry | None
    rejected: ShardEntry | None = None
    rows_in: int = Field(ge=0)
    rows_out: int = Field(ge=0)
    dropped: dict[str, int] = {}
    info: dict[str, Any] = {}

    @model_validator(mode="after")
    def _accounted(self) -> ShardResult:
        _check_accounting(self.rows_in, self.rows_out, self.dropped, self.shard.name if self.shard else "shard")
        return self


class Stamp(_Frozen):
    """What a stage's run is handed besides its data: its name, its fingerprint, the fingerprint's inputs
    (upstream digests, outside inputs) and the config sections it hashes, as its manifest records them. Made
    once, where the registry is read (`stages.registry.stamp`), so a stage never looks up its own sections."""

    stage: str
    fingerprint: str
    inputs: dict[str, str]
    config: dict[str, Any]


class Manifest(_Frozen):
    """A complete stage: written last, it is what makes the stage complete (contract 3)."""

    version: int = MANIFEST_VERSION
    stage: str
    fingerprint: str
    code_version: str
    config: dict[str, Any]
    inputs: dict[str, str | None]
    shards: tuple[ShardEntry, ...]
    rejected: tuple[ShardEntry, ...] = ()
    rows_in: int = Field(ge=0)
    rows_out: int = Field(ge=0)
    dropped: dict[str, int]
    tokens: int = Field(ge=0)
    extra: dict[str, Any] = {}

    @model_validator(mode="after")
    def _accounted(self) -> Manifest:
        _check_accounting(self.rows_in, self.rows_out, self.dropped, self.stage)
        return self

    def data_shards(self, split: str | None = None) -> list[ShardEntry]:
        """The data shards, optionally of one split (`split=None`: every split); side files (tokenize's token
        counts: shards with a `kind`) are not data shards."""
        return [s for s in self.shards if s.kind is None and (split is None or s.split == split)]

    def size(self) -> dict[str, Any]:
        """What the stage measured, as `plan` and `status` both show it: rows out; tokens its work covered (the
        tokens trained on, `extra.trained_tokens`; the sequences' tokens of features computed online,
        `extra.tokens`; else its shards' tokens); bytes; and per split what the next stage reads (0 rows
        where it keeps no split; train_tokens None where its rows are not counted in tokens)."""
        tokens = next((self.extra[k] for k in ("trained_tokens", "tokens") if self.extra.get(k) is not None),
                      self.tokens)
        train = self.data_shards("train")
        return {"basis": "measured", "rows": self.rows_out, "tokens": tokens,
                "bytes": sum(s.bytes for s in self.shards), "train_rows": sum(s.rows for s in train),
                "train_tokens": sum(s.tokens for s in train) or None,
                "eval_rows": sum(s.rows for s in self.data_shards("eval"))}

    def to_json(self) -> dict[str, Any]:
        """The manifest as written to disk (and digested): JSON values, unset shard fields left out."""
        data = self.model_dump(mode="json", exclude={"shards", "rejected"})
        return data | {"shards": [s.to_json() for s in self.shards], "rejected": [s.to_json() for s in self.rejected]}


class StageResult(_Frozen):
    """What a stage flow returns to the pipeline: where its output is and how it got there."""

    stage: str
    fingerprint: str
    status: Literal["ran", "reused"]
    digest: str
    path: str
    manifest: Manifest
    gate: dict[str, Any] | None = None  # evaluate: the verdict of `evaluate.gate`, applied after the stage


class CarriedFile(_Frozen):
    """A side file a stage made for stages further on (tokenize's token counts), as those stages read it:
    the folder it is in (the stage and fingerprint that wrote it) and its entry. A stage passes on the
    side files it was handed and does not replace (`carry`), so a stage put in between needs no edit."""

    stage: str
    fingerprint: str
    entry: ShardEntry


CARRIED = "carried"  # the manifest's extra key: name -> CarriedFile


def carried(manifest: Manifest) -> dict[str, CarriedFile]:
    """The side files `manifest`'s stage hands on, by name."""
    return {k: CarriedFile.model_validate(v) for k, v in (manifest.extra.get(CARRIED) or {}).items()}


def carry(upstream: Manifest, extra: dict[str, Any]) -> dict[str, Any]:
    """A stage's manifest `extra` with the side files it hands on: its upstream's, replaced or added to by name
    by its own (`extra[CARRIED]`)."""
    files = {k: v.model_dump(mode="json") for k, v in carried(upstream).items()} | (extra.get(CARRIED) or {})
    return {**extra, CARRIED: files} if files else extra


class StoredFeatures(_Frozen):
    """Features the extract stage stored: its train shards (each with the taps it holds)."""

    mode: Literal["stored"] = "stored"
    stage: str  # the stage (folder) that stored them
    fingerprint: str
    shards: tuple[ShardEntry, ...]
    token_counts: CarriedFile | None = None  # tokenize's counts of supervised tokens (draft vocabularies)


class OnlineFeatures(_Frozen):
    """Features computed per training step by a co-located target from the sequences extract was handed."""

    mode: Literal["online"] = "online"
    stage: str  # the stage (folder) holding the sequences: tokenize, or a stage put after it
    fingerprint: str
    shards: tuple[ShardEntry, ...]
    token_counts: CarriedFile | None = None


FeatureSource = Annotated[StoredFeatures | OnlineFeatures, Field(discriminator="mode")]


def read_feature_source(data: dict[str, Any]) -> StoredFeatures | OnlineFeatures:
    """A `FeatureSource` from its JSON (what the train stage hands each torchrun rank)."""
    return TypeAdapter(FeatureSource).validate_python(data)


def feature_source(extract: StageResult | Manifest) -> StoredFeatures | OnlineFeatures:
    """Where train reads its features, from the extract stage's result or manifest (stored shards or online
    mode), with the token counts handed on to it."""
    m = extract.manifest if isinstance(extract, StageResult) else extract
    counts = carried(m).get("token_counts")
    if m.extra.get("mode") == "online":
        seq = m.extra["sequences"]
        return OnlineFeatures(stage=seq["stage"], fingerprint=seq["fingerprint"], shards=seq["shards"],
                              token_counts=counts)
    return StoredFeatures(stage=m.stage, fingerprint=m.fingerprint, shards=m.data_shards("train"),
                          token_counts=counts)


def check_manifest(data: Any, where: str) -> Manifest | None:
    """`data` (a manifest read from `where`) as a `Manifest` if this code can use it, else None (recompute).

    Raises:
        ManifestError: written by a newer draftflow (its version is above MANIFEST_VERSION).
    """
    version = data.get("version", 1) if isinstance(data, dict) else None
    if isinstance(version, int) and version > MANIFEST_VERSION:
        raise ManifestError(f"{where} was written by a newer draftflow (manifest version {version} > "
                            f"{MANIFEST_VERSION}); upgrade draftflow, or use another root")
    try:
        return Manifest.model_validate(data | {"version": version} if isinstance(data, dict) else data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "manifest"
        log.warning("%s is not a valid manifest (%s: %s); the stage will be recomputed", where, field, first["msg"])
        return None
