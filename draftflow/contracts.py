"""The contracts between stages, typed: a shard's manifest entry, a shard task's result, a stage's
manifest and a stage flow's result.

Every one is checked where it crosses a boundary: a shard result when a shard function returns it
(`stages.common.shard_result`), a manifest when it is written (`stages.common.finalize`) and when it
is read back (`Store.read_manifest`), a stage result when a flow returns it. The JSON on disk stays
the readable dict it always was, plus a `version`; code passes the validated dicts (`model_dump`
is not applied, so extra fields a stage records, such as a shard's `split` or `layer_ids`, keep
their place and the manifest digest its meaning).

Versions: a manifest without `version` was written before versions existed and has the same
fields (version 1): it is read as such. A manifest of a newer version than this code knows is
refused in one line (`ManifestError`), never overwritten; one that is not a manifest at all is
treated as absent, so the stage is recomputed (contract 8).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from draftflow.errors import StoreError

MANIFEST_VERSION = 2  # 2: `version` recorded; 1: the same fields without it


class ManifestError(StoreError):
    """A manifest this version of draftflow must not read (written by a newer one)."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ShardEntry(BaseModel):
    """One committed file of a stage: what `store.shard_entry` records (stages may add fields)."""

    model_config = ConfigDict(frozen=True, extra="allow")
    name: str = Field(min_length=1)
    rows: int = Field(ge=0)
    tokens: int = Field(0, ge=0)
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


def _check_accounting(rows_in: int, rows_out: int, dropped: dict[str, int], what: str) -> None:
    lost = rows_in - rows_out - sum(dropped.values())
    if lost:
        raise ValueError(f"{what}: {lost} rows unaccounted for (rows_in={rows_in}, rows_out={rows_out}, "
                         f"dropped={dropped})")


class ShardResult(BaseModel):
    """What a shard task returns: its output and reject shards, and its accounting (contract 4)."""

    model_config = ConfigDict(frozen=True, extra="allow")  # stage-specific counts (finish reasons, ...)
    shard: ShardEntry | None
    rejected: ShardEntry | None
    rows_in: int = Field(ge=0)
    rows_out: int = Field(ge=0)
    dropped: dict[str, int]

    @model_validator(mode="after")
    def _accounted(self) -> ShardResult:
        _check_accounting(self.rows_in, self.rows_out, self.dropped, self.shard.name if self.shard else "shard")
        return self


class Manifest(_Frozen):
    """A complete stage: written last, it is what makes the stage complete (contract 3)."""

    version: int = 1
    stage: str
    fingerprint: str
    code_version: str
    config: dict[str, Any]
    inputs: dict[str, str | None]
    shards: list[ShardEntry]
    rejected: list[ShardEntry] = []
    rows_in: int = Field(ge=0)
    rows_out: int = Field(ge=0)
    dropped: dict[str, int]
    tokens: int = Field(ge=0)
    extra: dict[str, Any] = {}

    @model_validator(mode="after")
    def _accounted(self) -> Manifest:
        _check_accounting(self.rows_in, self.rows_out, self.dropped, self.stage)
        return self


class StageResult(_Frozen):
    """What a stage flow returns to the pipeline: where its output is and how it got there."""

    stage: str
    fingerprint: str
    status: Literal["ran", "reused"]
    digest: str
    path: str
    manifest: Manifest


def check_manifest(data: Any, where: str) -> dict[str, Any] | None:
    """`data` (a manifest read from `where`) if it is one this code can use, else None (recompute).

    Raises:
        ManifestError: written by a newer draftflow (its version is above MANIFEST_VERSION).
    """
    version = data.get("version", 1) if isinstance(data, dict) else None
    if isinstance(version, int) and version > MANIFEST_VERSION:
        raise ManifestError(f"{where} was written by a newer draftflow (manifest version {version} > "
                            f"{MANIFEST_VERSION}); upgrade draftflow, or use another root")
    try:
        Manifest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "manifest"
        import logging

        logging.getLogger(__name__).warning("%s is not a valid manifest (%s: %s); the stage will be recomputed",
                                            where, field, first["msg"])
        return None
    return data
