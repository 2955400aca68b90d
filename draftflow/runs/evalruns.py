"""Evaluations in run roots: find the evaluate stage's results, load their reports, and tell which
ones measured the same thing (the same target on the same eval set).

Used by the gate (`draftflow.runs.gating`: the best earlier evaluation of the same target and eval set)
and by `draftflow compare` (a run root, an evaluate folder or a report.json, each read as a list of
`Evaluation`). Two evaluations are comparable when their manifests name the same target
fingerprint (`inputs.target`) and their `eval_set` keys are equal: the eval prompts' sample ids
(curate's eval split, in order, read from the curate manifest whose digest is `inputs.curate`),
the evaluate settings that choose and bound what is decoded (`EVAL_SET_FIELDS`) and thinking on
or off. The drafter and how it is decoded (KV cache, engine) are not part of it: they are what
is being compared.

What it does not know: Prefect, torch, the stages' code (it reads files only, so `compare` is
fast). Trade-off: when curate's manifest is no longer in the root, the eval set falls back to the
curate manifest's digest, which also changes with the training split (two such evaluations of
one eval split then look different, and a regression check finds nothing to compare with).
"""

from __future__ import annotations

import logging
import posixpath
from dataclasses import dataclass, field
from typing import Any

from draftflow.contracts import Manifest, StageResult
from draftflow.errors import DraftflowError
from draftflow.store import MANIFEST, Store, digest

log = logging.getLogger(__name__)
REPORT = "report.json"
GATE = "gate.json"  # the last gate verdict on this evaluation (`draftflow.runs.gating`)
# Evaluate settings that choose which prompts are decoded and for how long: equal values on equal
# eval splits decode the same prompts (the selection is deterministic).
EVAL_SET_FIELDS = ("num_prompts", "categories", "max_new_tokens")


@dataclass
class Evaluation:
    """One evaluation: its report and, when it is a complete evaluate stage, its manifest."""

    label: str
    path: str  # the evaluate folder, or the report.json's folder (as the user sees it: s3://… for S3)
    report: dict[str, Any]
    fingerprint: str | None = None
    manifest: Manifest | None = None
    gate: dict[str, Any] | None = None
    eval_set: str | None = field(default=None, repr=False)

    @property
    def target(self) -> str | None:
        return self.manifest.inputs.get("target") if self.manifest else None

    @property
    def tau(self) -> float | None:
        tau = self.report.get("tau")
        return None if tau is None else float(tau)


def evaluate_stage() -> str:
    """The folder of the evaluate stage: the registry's maker of evaluations (never a name written here)."""
    from draftflow.stages.registry import maker

    return maker("evaluation")


def _curate_stage() -> str:
    """The folder of the stage whose eval split evaluations decode (the registry's maker of conversations)."""
    from draftflow.stages.registry import maker

    return maker("conversations")


class NoEvaluation(DraftflowError):
    """A path named as an evaluation holds none."""


def curate_index(store: Store) -> dict[str, str]:
    """{manifest digest: fingerprint} of every complete curate result in the root."""
    out = {}
    for path in store.fs.glob(store.path(_curate_stage(), "*", MANIFEST)):
        try:
            out[digest(store.read_json(path))] = path.rstrip("/").split("/")[-2]
        except (OSError, ValueError):
            continue
    return out


def eval_ids(store: Store, curate_fp: str) -> list[str] | None:
    """The sample ids of curate's eval split, in the order the evaluate stage reads them; None if unreadable."""
    import pyarrow.parquet as pq

    stage = _curate_stage()
    try:
        manifest = store.read_json(store.stage_path(stage, curate_fp, MANIFEST))
        ids: list[str] = []
        for shard in manifest["shards"]:
            if shard.get("split") == "eval":
                with store.fs.open(store.stage_path(stage, curate_fp, shard["name"]), "rb") as fh:
                    ids += pq.read_table(fh, columns=["sample_id"]).column("sample_id").to_pylist()
        return ids
    except (OSError, ValueError, KeyError) as exc:
        log.warning("curate %s: eval ids unreadable (%s); its digest stands for the eval set", curate_fp, exc)
        return None


def eval_set_key(store: Store, manifest: Manifest, index: dict[str, str] | None = None) -> str:
    """What an evaluate manifest measured on, as a short digest (see the module docstring).

    Args:
        index: `curate_index(store)`, when the caller keys several manifests (read once).
    """
    cfg = manifest.config
    ev = cfg.get("evaluate") or {}
    curate_digest = manifest.inputs.get(_curate_stage())
    index = curate_index(store) if index is None else index
    ids = eval_ids(store, index[curate_digest]) if curate_digest in index else None
    basis = {
        "prompts": ids if ids is not None else {"curate": curate_digest},
        "thinking": cfg.get("regenerate.enable_thinking"),
        **{k: ev.get(k) for k in EVAL_SET_FIELDS},
    }
    return digest(basis)[:16]


def _read_optional(store: Store, path: str) -> dict[str, Any] | None:
    try:
        return store.read_json(path) if store.exists(path) else None
    except (OSError, ValueError):
        return None


def load(store: Store, fp: str, label: str | None = None) -> Evaluation | None:
    """The evaluation under `evaluate/<fp>` of `store`: with its manifest when the stage is complete
    (its report then checked against its sha256), else from a bare report.json; None when neither."""
    stage = evaluate_stage()
    return _evaluation(store, stage, fp, store.read_manifest(stage, fp), label)


def of_result(store: Store, evaluated: StageResult) -> Evaluation | None:
    """The evaluation of a complete evaluate stage result, as its flow hands it over: the manifest it carries,
    its report read (and checked against the manifest) from the folder the result names."""
    return _evaluation(store, evaluated.stage, evaluated.fingerprint, evaluated.manifest)


def _evaluation(store: Store, stage: str, fp: str, manifest: Manifest | None,
                label: str | None = None) -> Evaluation | None:
    path = store.stage_path(stage, fp, REPORT)
    if manifest is not None:
        entry = next((s for s in manifest.shards if s.name == REPORT), None)
        report = store.read_json(store.verify_sha(stage, fp, entry) if entry else path)
    else:
        report = _read_optional(store, path)
        if report is None:
            return None
    name = posixpath.basename(store.base.rstrip("/")) or store.base
    return Evaluation(
        label or f"{name}/{fp}",
        store.url(store.stage_path(stage, fp)),
        report,
        fp,
        manifest,
        _read_optional(store, store.stage_path(stage, fp, GATE)),
    )


def in_root(store: Store, with_eval_set: bool = False) -> list[Evaluation]:
    """Every evaluation in the root (complete ones, and bare reports), oldest report first.

    Args:
        with_eval_set: also key each complete one's eval set (reads curate's eval ids once).
    """
    found = []
    for path in store.fs.glob(store.path(evaluate_stage(), "*", REPORT)):
        fp = path.rstrip("/").split("/")[-2]
        ev = load(store, fp)
        if ev is not None:
            found.append((_mtime(store, path), fp, ev))
    evs = [ev for _, _, ev in sorted(found, key=lambda t: (t[0], t[1]))]
    if with_eval_set:
        index = curate_index(store)
        for ev in evs:
            ev.eval_set = eval_set_key(store, ev.manifest, index) if ev.manifest else None
    return evs


def _mtime(store: Store, path: str) -> float:
    try:
        return store.fs.modified(path).timestamp()
    except (OSError, NotImplementedError, AttributeError, ValueError):
        return 0.0


def _split(url: str) -> tuple[str, str]:
    """(folder, last part) of a local path or fsspec URL, without a trailing slash."""
    url = url.rstrip("/")
    head, _, tail = url.rpartition("/")
    return head, tail


def resolve(arg: str) -> list[Evaluation]:
    """The evaluations `arg` names: a run root (every evaluation in it), an evaluate folder
    (`<root>/evaluate/<fingerprint>`) or a report.json file (a run config: `draftflow.runs.compare`, which
    resolves it through the config's stages; the gate, run inside the evaluate flow, never loads a config).

    Raises:
        NoEvaluation: `arg` is none of these (one line naming it and what to pass).
    """
    import os

    import fsspec

    arg = arg if "://" in arg else os.path.abspath(arg)  # labels and folders of relative paths read whole
    fs, base = fsspec.core.url_to_fs(arg)
    base = base.rstrip("/")
    if base.endswith(".json") and fs.isfile(base):
        folder, _ = _split(arg)
        got = from_folder(folder)
        if got is not None and posixpath.basename(base) == REPORT:
            return [got]
        with fs.open(base, "rb") as fh:
            import json

            return [Evaluation(arg, folder, json.loads(fh.read()))]
    if fs.isfile(f"{base}/{REPORT}"):
        got = from_folder(arg)
        if got is not None:
            return [got]
    if fs.isdir(f"{base}/{evaluate_stage()}"):
        evs = in_root(Store(arg))
        if evs:
            return evs
    raise NoEvaluation(
        f"no evaluation at {arg}: pass a run root that holds evaluate/ results (e.g. runs/tiny), "
        "an evaluate folder (runs/tiny/evaluate/<fingerprint>) or a report.json"
    )


def from_folder(folder: str) -> Evaluation | None:
    """The evaluation in `folder` when it sits at `<root>/evaluate/<fp>` (manifest-checked), else None."""
    parent, fp = _split(folder)
    root, stage = _split(parent)
    if stage != evaluate_stage() or not root:
        return None
    store = Store(root)
    ev = load(store, fp)
    if ev is not None and ev.manifest is not None:
        ev.eval_set = eval_set_key(store, ev.manifest)
    return ev
