"""What every drafter kind's export shares: the folder writer, names, the training record.

An export folder holds the drafter's own weights only (the target's embedding and LM head are
shared at serve time) in `model.safetensors`, a `config.json`, and a `README.md` with the exact
serve line (`draftflow.export_readme`); a kind may add files (DFlash: its transformers modeling
file). A vLLM-native `config.json` also records how vLLM serves it (`export_readme.SERVE_KEY`), so
a folder is served, and its README written, without knowing which kind made it. The kinds' own
formats and the facts they rely on: `draftflow/drafters/<kind>/export.py`.

What it does not know: training, stores (it writes a local folder; the train stage copies it into
the artifact store), any kind's tensor names. Trade-off: one rename rule (`rename_tensor`) for
every table, so a name vLLM would not recognise fails the export, not the server.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftflow.compat import config_dtype
from draftflow.errors import StoreError
from draftflow.export_readme import README_NAME, portable_target_name, write_readme
from draftflow.models.weights import CONFIG_NAME, WEIGHTS_NAME, write_weights_and_config
from draftflow.store import write_local_atomic

EXPORT_FILES = (CONFIG_NAME, WEIGHTS_NAME, README_NAME)  # in every export folder
# What the drafter was trained on that serving does not need but a later evaluation does (the feature
# rounding: `evaluate.compare_with` of an export). Written by the train stage beside its exports only.
TRAINED_ON_NAME = "draftflow.json"


def default_target_name(target_config: Any) -> str:
    """The portable name of the target a config was loaded from (`_name_or_path`; "target" when unset)."""
    return portable_target_name(getattr(target_config, "_name_or_path", None) or None, "target")


def dtype_name(target_config: Any) -> str:
    dtype = config_dtype(target_config) or "bfloat16"
    return str(dtype).removeprefix("torch.")


def rename_tensor(name: str, table: dict[str, str]) -> str:
    """`name` with its prefix renamed by `table` (the first prefix that matches)."""
    for src, dst in table.items():
        if name.startswith(src):
            return dst + name[len(src):]
    raise StoreError(f"parameter {name!r} has no entry in the kind's export name table; add one")


def renamed(weights: dict[str, torch.Tensor], table: dict[str, str]) -> dict[str, torch.Tensor]:
    """Every tensor renamed by `table`, detached, on the CPU, contiguous (ready for safetensors)."""
    return {rename_tensor(k, table): v.detach().cpu().contiguous() for k, v in weights.items()}


@dataclass(frozen=True)
class KindFiles:
    """What a kind adds to its export folder: its title for the README heading (`DrafterSpec.title`), more
    files (name -> bytes) and README lines at the end (e.g. how to load it with transformers)."""

    title: str | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    readme: tuple[str, ...] = ()


def write_export(out_dir: str | Path, config: dict, weights: dict[str, torch.Tensor], target_name: str,
                 served_from: str | None = None, target_config: Any = None, kind: KindFiles = KindFiles()) -> Path:
    """An export folder: `config.json`, `model.safetensors` (already renamed), `README.md` and the kind's
    own files, each written atomically.

    Args:
        target_name: the portable target name the README's serve line uses.
        served_from: the folder's path in the serve line; default: `out_dir`, absolute.
        target_config: the target's HF config; the README reads its folder (`_name_or_path`) for a GGUF
            target's conversion record.
        kind: the kind's title, files and README lines.
    """
    out = write_weights_and_config(out_dir, weights, config)
    for name, data in kind.files.items():
        write_local_atomic(out / name, lambda tmp, data=data: Path(tmp).write_bytes(data))
    write_readme(out, config, target_name, served_from or str(out.resolve()),
                 getattr(target_config, "_name_or_path", None) or None, kind.title, kind.readme)
    return out


def write_trained_on(out_dir: str | Path, trained_on: dict[str, Any]) -> None:
    """`TRAINED_ON_NAME` in an export folder, atomically (keys sorted: the same training, the same bytes)."""
    text = json.dumps(trained_on, indent=2, sort_keys=True) + "\n"
    write_local_atomic(Path(out_dir) / TRAINED_ON_NAME, lambda tmp: Path(tmp).write_text(text))


def read_trained_on(folder: str | Path) -> dict[str, Any]:
    """An export folder's `TRAINED_ON_NAME` ({} when it has none: exported outside a train stage, or before it
    was written)."""
    path = Path(folder) / TRAINED_ON_NAME
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise StoreError(f"{path}: not JSON ({exc}); delete it or re-export the drafter") from None
    return data if isinstance(data, dict) else {}
