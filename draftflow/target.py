"""The target model: resolve, fingerprint, load, and build the tiny offline one.

A target is always an ordinary HF model folder (or hub id), so every stage
loads `Qwen/Qwen3-8B`, a local path and the tiny demo target through the
same code path. The tiny target is a Qwen3-architecture causal LM with random
weights from a fixed seed and a byte-level BPE tokenizer trained on the
bundled sample text, with a ChatML template written for draftflow. It is
built deterministically, so its fingerprint is stable across machines.
`check_target_files` checks a local target's config and weights from their headers only
(a safetensors file's 8-byte length, JSON header and the size its offsets imply), so a
half-written download stops preflight in one line instead of failing at load.
A GGUF target (a .gguf path, or package + file) is converted once into such a folder
(`draftflow.gguf_target`).
This module does not know about stages, stores or Prefect.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

from draftflow.compat import importing_transformers, quiet_progress
from draftflow.config import TargetConfig, TinyTargetConfig
from draftflow.errors import ConfigError
from draftflow.gguf_target import convert_gguf, gguf_source
from draftflow.kept import default_cache_dir, kept_answer
from draftflow.store import shared_mode

log = logging.getLogger(__name__)

ASSETS = Path(__file__).parent / "assets"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# ChatML with a Qwen3-like <think> block, written for draftflow. Every assistant
# turn renders its (possibly empty) reasoning, so the template is prefix-stable:
# the rendering of a history is a prefix of the rendering of any continuation.
# With enable_thinking=false the generation prompt pre-fills an empty think block.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}"
    "<|im_start|>assistant\n<think>\n{{ (m.get('reasoning_content') or '') | trim }}\n</think>\n\n"
    "{{ m['content'] }}<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


@dataclass(frozen=True)
class TargetRef:
    """Where the target lives and the fingerprint that stands for its content."""

    path: str
    fingerprint: str


def folder_fingerprint(path: Path) -> str:
    """sha256 over every file's relative name and content (weights included).

    Cached by the files' names, sizes and mtimes, in this process and on disk under the
    cache directory (`fingerprints/`), so a 16 GB model folder is read once per machine
    and version of its files, not on every `draftflow run` or `status`. Like curate's
    source keys, an in-place rewrite that keeps every size and mtime is not seen.
    """
    stat = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(path.rglob("*")) if f.is_file())
    return kept_answer("fingerprints", repr((str(path.resolve()), stat)), lambda: _content_hash(path, stat)).strip()


@functools.lru_cache(maxsize=8)
def _content_hash(path: Path, stat: tuple) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def resolve_target(cfg: TargetConfig, cache_dir: Path | None = None) -> TargetRef:
    """Return a loadable path and a content fingerprint for the configured target.

    `path: null` builds (once) the tiny target under the cache directory.
    A local folder is fingerprinted by content; a hub id by id and revision; a GGUF file
    (a .gguf path, or package + file) by its sha256 and the stored dtype, once converted.
    """
    gguf = gguf_source(cfg)
    if gguf is not None:
        folder = convert_gguf(gguf, cfg.dtype, cache_dir or default_cache_dir(), lock=_LOAD_LOCK)
        return TargetRef(str(folder), folder.name)  # gguf-<sha256[:16]>-<dtype>
    if cfg.path is None:
        return build_tiny_target(cfg.tiny, cache_dir or default_cache_dir())
    local = Path(cfg.path).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise ConfigError(f"target.path {local} has no config.json; point it at an HF model folder")
        return TargetRef(str(local), "local-" + folder_fingerprint(local))
    if cfg.path.startswith((".", "/", "~")):
        raise ConfigError(f"target.path {cfg.path} does not exist; give an HF model id or a model folder")
    if cfg.revision is None:
        log.warning("target %s has no revision pinned; the cache cannot see hub updates", cfg.path)
    return TargetRef(cfg.path, f"hf-{cfg.path}@{cfg.revision or 'unpinned'}".replace("/", "--"))


# A safetensors header is a few KB to a few MB of JSON; anything bigger is not a header.
MAX_SAFETENSORS_HEADER = 100 << 20
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def check_target_files(path: str | Path) -> None:
    """A local target folder's config.json is JSON and its weights are whole (headers only; no weights read).

    Raises:
        ConfigError: naming the file and what is wrong (missing, not JSON, truncated, a shard missing).
    """
    folder = Path(path)
    _read_json(folder / "config.json", "target.path")
    present = [name for name in WEIGHT_FILES if (folder / name).is_file()]
    if not present:
        raise ConfigError(f"target.path {folder} has no weights (none of {', '.join(WEIGHT_FILES)}); "
                          "finish the download or point target.path at a complete model folder")
    if "model.safetensors.index.json" in present:
        index = _read_json(folder / "model.safetensors.index.json", "target.path")
        shards = sorted(set((index.get("weight_map") or {}).values())) if isinstance(index, dict) else []
        for name in shards:
            if not (folder / name).is_file():
                raise ConfigError(f"target weights {folder / name} (listed in model.safetensors.index.json) are "
                                  "missing; finish the download of target.path")
            check_safetensors(folder / name)
    elif "model.safetensors" in present:
        check_safetensors(folder / "model.safetensors")


def _read_json(file: Path, field: str) -> object:
    try:
        return json.loads(file.read_bytes())
    except FileNotFoundError:
        raise ConfigError(f"{field} {file.parent} has no {file.name}; point it at an HF model folder") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{file} is not JSON ({exc}); re-download {field} {file.parent}") from None


def check_safetensors(file: Path) -> None:
    """The file is a whole safetensors file: an 8-byte header length, a JSON header, and exactly the
    bytes its tensors' data_offsets end at (a truncated or half-written file is caught here)."""
    size = file.stat().st_size
    with open(file, "rb") as fh:
        head = fh.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= min(MAX_SAFETENSORS_HEADER, size - 8):
            raise ConfigError(f"target weights {file} are not a safetensors file ({size} bytes, header length "
                              f"{n}): truncated or corrupt; re-download target.path")
        try:
            header = json.loads(fh.read(n))
            end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            raise ConfigError(f"target weights {file} have an unreadable safetensors header ({exc}); "
                              "re-download target.path") from None
    if 8 + n + end != size:
        raise ConfigError(f"target weights {file} have {size} bytes but their header describes {8 + n + end}: "
                          "a truncated (half-written) file; finish or redo the download of target.path")


def build_tiny_target(cfg: TinyTargetConfig, cache_dir: Path) -> TargetRef:
    """Build the tiny target into `cache_dir/tiny-<hash>` unless it is already there."""
    key = _tiny_key(cfg)
    out = Path(cache_dir) / f"tiny-{key}"
    if not (out / ".complete").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tiny-{key}-", dir=out.parent))
        tmp.chmod(shared_mode(directory=True))  # mkdtemp makes 0700
        with _LOAD_LOCK, quiet_progress():  # construction must not overlap a from_pretrained elsewhere
            _write_tiny_target(cfg, tmp)
        (tmp / ".complete").write_text(folder_fingerprint(tmp))
        if out.exists():  # an incomplete earlier attempt
            shutil.rmtree(out)
        os.replace(tmp, out)
        log.info("built tiny target at %s", out)
    return TargetRef(str(out), "tiny-" + (out / ".complete").read_text().strip())


def _tiny_key(cfg: TinyTargetConfig) -> str:
    """Everything the tiny build depends on: config, this module's code, corpus, library versions."""
    from importlib.metadata import version

    h = hashlib.sha256(json.dumps(cfg.model_dump(), sort_keys=True).encode())
    h.update(Path(__file__).read_bytes())
    for f in sorted((ASSETS / "sample_data").iterdir()):
        h.update(f.name.encode() + f.read_bytes())
    h.update(" ".join(version(p) for p in ("tokenizers", "transformers", "torch")).encode())
    return h.hexdigest()[:12]


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    with importing_transformers():
        from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=TINY_CHAT_TEMPLATE,
    )


def _corpus_lines() -> list[str]:
    """Every text of the bundled sample data, in a fixed order."""
    import pyarrow.parquet as pq

    lines: list[str] = []
    for path in sorted((ASSETS / "sample_data").glob("*.jsonl")):
        lines.extend(path.read_text().splitlines())
    table = pq.read_table(ASSETS / "sample_data" / "alpaca.parquet")
    for row in table.to_pylist():
        lines.extend(str(v) for v in row.values())
    return lines


def _write_tiny_target(cfg: TinyTargetConfig, out: Path) -> None:
    import torch
    with importing_transformers():
        from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tokenizer = _train_tokenizer(cfg.vocab_size)
    # Room for the DFlash mask token at id len(tokenizer), padded to a multiple of 64.
    vocab = ((len(tokenizer) + 1 + 63) // 64) * 64
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=pad,
        dtype="float32",  # transformers 4.56 renamed torch_dtype
    )
    torch.manual_seed(cfg.seed)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        # Padding rows (ids >= len(tokenizer), the mask token among them) get a zero
        # logit, below the random logits of real tokens: greedy never emits them.
        model.lm_head.weight[len(tokenizer):] = 0.0
    model.generation_config = GenerationConfig(eos_token_id=[eos], pad_token_id=pad, do_sample=False)
    model.save_pretrained(out)  # safetensors: the default in 4.x, the only format in 5.x
    tokenizer.save_pretrained(out)


_LOAD_LOCK = threading.Lock()


def load_target(path: str, dtype: str = "auto", device: str = "auto"):
    """Load (once per process) the target model in eval mode with its tokenizer: (model, tokenizer). On the CPU
    its linear layers are `draftflow.small_rows.SmallRowsLinear` (fast for the few rows of a verify step).

    Loading is serialized: transformers builds models under a process-wide meta-device context, so a second
    thread constructing a model at the same time would get meta tensors.
    """
    with _LOAD_LOCK:
        return _load_target(path, dtype, resolve_device(device))


def release_targets() -> None:
    """Forget the targets this process loaded and return their GPU memory (they reload on demand)."""
    import gc

    import torch

    with _LOAD_LOCK:
        _load_target.cache_clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check_loading_info(path: str, info: dict) -> None:
    """Refuse a target whose checkpoint lacks weights its config asks for, or holds ones it does not.

    transformers initialises missing weights at random and only logs it: a target with a
    `config.json` of more layers than its safetensors hold would regenerate, extract, train and
    evaluate on noise, exit 0. Here that is one line naming the tensors.

    Raises:
        ConfigError: missing, unexpected or mismatched tensors (at most 3 names of each shown).
    """
    def names(key: str) -> list[str]:
        return sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(key) or ())

    parts = []
    for key, what in (("missing_keys", "missing"), ("unexpected_keys", "unexpected"),
                      ("mismatched_keys", "of another shape")):
        found = names(key)
        if found:
            more = f" and {len(found) - 3} more" if len(found) > 3 else ""
            parts.append(f"{len(found)} {what} ({', '.join(found[:3])}{more})")
    if parts:
        raise ConfigError(f"target {path}: its weights do not match its config.json: {'; '.join(parts)}; fix the "
                          "checkpoint or config.json (draftflow never runs a target with randomly initialised weights)")


@functools.lru_cache(maxsize=2)
def _load_target(path: str, dtype: str, device: str):
    import torch
    with importing_transformers():
        from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftflow.small_rows import use_small_rows

    torch_dtype = {
        "auto": torch.bfloat16 if device.startswith("cuda") else torch.float32,
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
    }[dtype]
    tokenizer = AutoTokenizer.from_pretrained(path)
    try:
        # Mismatched shapes reported (not raised) so `check_loading_info` names them with the rest.
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, output_loading_info=True,
                                                           ignore_mismatched_sizes=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"target {path}: its weights do not load into the model its config.json describes "
                          f"({first}); fix the checkpoint or config.json") from None
    check_loading_info(path, info)
    model = model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    if device == "cpu":  # verify and drafting passes carry a few rows: torch's CPU kernel for those is slow
        use_small_rows(model)
    return model, tokenizer


_LOCKS: weakref.WeakKeyDictionary[object, threading.Lock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def model_lock(model) -> threading.Lock:
    """One lock per loaded model: forward passes on a shared model run one at a time.

    transformers records `output_hidden_states` through hooks stored on the model
    object, so two threads running the same model at once corrupt each other's
    outputs; shard tasks on a thread pool share the process-wide cached model.
    """
    with _LOCKS_GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.Lock()
        return lock


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def eos_token_ids(model, tokenizer) -> set[int]:
    """End-of-turn ids: the generation config's eos ids plus the tokenizer's eos."""
    ids = model.generation_config.eos_token_id
    out = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        out.add(tokenizer.eos_token_id)
    return out
