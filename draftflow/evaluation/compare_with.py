"""Other trained drafters decoded beside the run's own: `evaluate.compare_with`.

Each name in `evaluate.compare_with` is a train stage fingerprint of this run root, a train stage
folder (`<root>/train/<fp>`), or an export folder (a vLLM-native or speculators export of either
kind, loaded by `draftflow.drafters.registry.load_exported`). `resolve` finds it and what enters the
evaluate fingerprint for it (the train manifest's digest, or the sha256 of every export file), so a
retrained or re-exported comparison re-runs evaluate. `decode_others` decodes the run's very prompts
with each one through the run's loop (KV-cached unless `evaluate.kv_cache` is false), each drafter
with its own taps and its own feature rounding (the extract dtype it was trained on), and checks its
tokens against the run's greedy outputs (lossless). Results go under report.json `baselines` as
`drafter:<label>`, so the report tables, plots and `draftflow compare` carry them unchanged.

What it does not know: Prefect, loading a train stage's checkpoint (the evaluate stage does it),
report text, stage names (a train stage is the one whose manifest lists exports). Feature rounding: the extract
dtype it was trained on is read from the `draftflow.json` the train stage writes beside its exports; an export without
one (exported by hand) is rounded with the run's `extract.dtype`. Trade-off: only a train stage can be
checked against the target's fingerprint; an export is checked by its hidden size and vocabulary.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftflow import progress
from draftflow.contracts import Manifest
from draftflow.errors import ConfigError, LosslessError
from draftflow.store import MANIFEST, Store, digest, sha256_file

log = logging.getLogger(__name__)
FINGERPRINT = re.compile(r"^[0-9a-f]{16}$")
PREFIX = "drafter:"


@dataclass(frozen=True)
class OtherDrafter:
    """One resolved `evaluate.compare_with` entry.

    Attributes:
        name: as written in the config. label: its key under report.json `baselines` (`drafter:…`).
        root, stage, fingerprint: the run root, stage folder and fingerprint of a train stage (None for an export).
        folder: the export folder (None for a train stage).
        digest: what enters the evaluate fingerprint for it.
        target: the target fingerprint it was trained for (train stage) or None (export).
        extract_dtype: the feature storage dtype it was trained on, when known.
    """

    name: str
    label: str
    digest: str
    root: str | None = None
    stage: str | None = None
    fingerprint: str | None = None
    folder: str | None = None
    target: str | None = None
    extract_dtype: str | None = None


def _trained(store: Store, fp: str, stage: str = "*") -> Manifest | None:
    """The manifest of the stage `fp` of `store` (in folder `stage`; "*": whichever) that trained a drafter: one
    listing export files. Found by what it holds, not by a stage name."""
    for path in store.fs.glob(store.stage_path(stage, fp, MANIFEST)):
        manifest = store.read_manifest(path.rstrip("/").split("/")[-3], fp)
        if manifest is not None and _trained_on_entry(manifest) is not None:
            return manifest
    return None


def _trained_on_entry(manifest: Manifest) -> str | None:
    """The name of the `draftflow.json` (what it was trained on) among a train stage's exports, or None."""
    from draftflow.drafters.export import TRAINED_ON_NAME  # not at the top: it imports torch

    return next((f["name"] for f in manifest.extra.get("files") or [] if f.get("name", "").startswith("export/")
                 and f["name"].endswith(f"/{TRAINED_ON_NAME}")), None)


def _from_train(store: Store, name: str, fp: str, stage: str = "*") -> OtherDrafter | None:
    manifest = _trained(store, fp, stage)
    if manifest is None:
        return None
    kind = (manifest.config.get("drafter") or {}).get("kind", "drafter")
    trained_on = store.read_json(store.stage_path(manifest.stage, fp, _trained_on_entry(manifest)))
    return OtherDrafter(
        name=name,
        label=f"{PREFIX}{kind}@{fp[:8]}",
        digest=digest(manifest.to_json()),
        root=store.root,
        stage=manifest.stage,
        fingerprint=fp,
        target=manifest.inputs.get("target"),
        extract_dtype=trained_on.get("extract_dtype"),
    )


def _from_export(name: str, folder: Path) -> OtherDrafter:
    from draftflow.drafters.export import read_trained_on
    from draftflow.drafters.registry import spec_for_export

    files = sorted(p for p in folder.iterdir() if p.is_file())
    sums = {p.name: sha256_file(p) for p in files}
    data = json.loads((folder / "config.json").read_text())
    kind = spec_for_export(data).kind
    return OtherDrafter(
        name=name, label=f"{PREFIX}{kind}@{folder.parent.name}/{folder.name}", digest=digest(sums), folder=str(folder),
        extract_dtype=read_trained_on(folder).get("extract_dtype"),
    )


def resolve(store: Store, name: str) -> OtherDrafter:
    """The drafter `name` stands for (see the module docstring).

    Raises:
        ConfigError: nothing complete is there (one line naming it and what to give instead).
    """
    if FINGERPRINT.match(name):
        found = _from_train(store, name, name)
        if found is not None:
            return found
    path = Path(name).expanduser()
    if (path / MANIFEST).is_file():  # a train stage folder, <root>/<stage>/<fp>
        found = _from_train(Store(str(path.parent.parent)), name, path.name, path.parent.name)
        if found is not None:
            return found
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return _from_export(name, path)
    raise ConfigError(
        f"evaluate.compare_with: {name!r} is no complete train stage of {store.root} nor a train "
        "stage folder nor an export folder (config.json + *.safetensors); name one, or remove it"
    )


def resolve_all(root: str, names: Sequence[str]) -> list[OtherDrafter]:
    """`resolve` for every name, in order; labels made unique by their position when two collide."""
    store = Store(root)
    out = [resolve(store, n) for n in names]
    labels = [o.label for o in out]
    return [
        o if labels.count(o.label) == 1 else OtherDrafter(**{**o.__dict__, "label": f"{o.label}#{i}"})
        for i, o in enumerate(out)
    ]


def fingerprint_input(root: str, names: Sequence[str]) -> str:
    """What the evaluate fingerprint takes for `evaluate.compare_with`: each name with its content digest."""
    return digest([[o.name, o.digest] for o in resolve_all(root, names)])


def _dims(data: Any) -> dict[str, int]:
    """The first `hidden_size` and `vocab_size` found in a (nested) export config."""
    found: dict[str, int] = {}
    todo = [data]
    while todo:
        d = todo.pop(0)
        if isinstance(d, dict):
            for key in ("hidden_size", "vocab_size"):
                if isinstance(d.get(key), int):
                    found.setdefault(key, d[key])
            todo += [v for v in d.values() if isinstance(v, dict)]
    return found


def check_target(other: OtherDrafter, target_fp: str, target_config: dict[str, Any] | None) -> None:
    """One line when `other` was trained for another target than the run's.

    Args:
        target_config: the target's config.json (None: the export's dimensions are not checked).
    """
    if other.target is not None and other.target != target_fp:
        raise ConfigError(
            f"evaluate.compare_with: {other.name} was trained for another target "
            f"({other.target}, this run's is {target_fp}); compare drafters of the same target"
        )
    if other.folder is None or target_config is None:
        return
    dims = _dims(json.loads((Path(other.folder) / "config.json").read_text()))
    for key, value in dims.items():
        if key in target_config and target_config[key] != value:
            raise ConfigError(
                f"evaluate.compare_with: {other.name} has {key} {value} but the target has "
                f"{target_config[key]}: it drafts for another target; remove it"
            )


def check_compare_with(root: str, names: Sequence[str], target_fp: str, target_path: str) -> None:
    """Preflight: every named drafter exists and drafts for this target (one line otherwise)."""
    if not names:
        return
    config = Path(target_path) / "config.json"
    target_config = json.loads(config.read_text()) if config.is_file() else None
    for other in resolve_all(root, names):
        check_target(other, target_fp, target_config)


def rounding_for(other: OtherDrafter, drafter, default_dtype: str):
    """The feature rounding `other` was trained with (its extract dtype, else `default_dtype`)."""
    from draftflow.features import round_trip

    dtype = other.extract_dtype or default_dtype
    if other.extract_dtype is None:
        log.info("compare_with %s: extract dtype unknown, features rounded as %s", other.name, dtype)
    return functools.partial(round_trip, dtype=dtype, n_taps=len(drafter.config.target_layer_ids))


def decode_others(
    target,
    others: list[tuple[OtherDrafter, Any, Any]],
    prompts: list[list[int]],
    reference: list[list[int]],
    categories: Sequence[str],
    ecfg,
    eos_ids: set[int],
) -> dict[str, Any]:
    """Decode `prompts` with each other drafter; per label its stats, `categories` split, source and kind.

    Args:
        others: (resolved entry, loaded drafter, its feature rounding) per drafter.
        reference: the run's checked greedy outputs, one per prompt (same order as `prompts`).

    Raises:
        LosslessError: a drafter's tokens differ from `reference` (one line naming it).
    """
    from draftflow.evaluation.cached import speculative_generate_cached
    from draftflow.evaluation.decode import check_lossless, drafts_per_step, speculative_generate
    from draftflow.evaluation.suite import split_stats, with_counts

    loop = speculative_generate_cached if ecfg.kv_cache else speculative_generate
    report: dict[str, Any] = {}
    for n, (other, drafter, rounding) in enumerate(others):
        drafter.eval()
        lengths, outputs = [], []
        for i, prompt in enumerate(prompts):
            tokens, acc = loop(target, drafter, prompt, ecfg.max_new_tokens, eos_ids, rounding)
            try:
                check_lossless(i, tokens, reference[i])
            except LosslessError as exc:
                raise LosslessError(f"evaluate.compare_with {other.name}: {exc}") from None
            lengths.append(acc)
            outputs.append(tokens)
            progress.within("evaluate", n * len(prompts) + i + 1, len(others) * len(prompts), "decodes")
        width = drafts_per_step(drafter) + 1
        report[other.label] = with_counts(lengths, outputs, width) | {
            "categories": split_stats(lengths, outputs, categories, width),
            "source": other.name,
            "architecture": drafter.config.architecture,
        }
        log.info("compare_with %s (%s): tau %s", other.label, other.name, report[other.label]["tau"])
    return report
