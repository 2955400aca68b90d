"""transformers 4 / 5 differences, in one place.

draftflow runs on transformers 4.57 (the CPU default) and 5.16-5.19 (what current vLLM pins), so
library code reads a target's HF config through these helpers instead of attributes that moved.
Each helper names the transformers version that changed the API. Call sites that are already
portable (`from_pretrained(dtype=...)`, `apply_chat_template(..., return_dict=...)` with the
argument spelled out) need nothing here.

What it deliberately does not know: model families beyond the config fields they share. The key
trade-off: duck-typed reads (attribute present or not) rather than version checks, so a config
written by either version, or a plain namespace in tests, works the same.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

DEFAULT_ROPE_THETA = 10000.0
_IMPORTING = threading.RLock()


@contextmanager
def importing_transformers() -> Iterator[None]:
    """Hold this around every import from transformers: its lazy top-level module is not thread-safe on first use.
    Several shard tasks (threads) of a stage that first touch `transformers.AutoTokenizer` at once made all but one
    fail with "ImportError: cannot import name 'AutoTokenizer' from 'transformers'" (a re-run whose first stage to
    use transformers was tokenize, 2026-12-07; Prefect's retry then passed). One process-wide lock, re-entrant (an
    import under it may import a module that takes it), makes the first import one thread's."""
    with _IMPORTING:
        yield


def _rope_parameters(config: Any) -> Mapping[str, Any] | None:
    """transformers 5.0 moved `rope_theta` and `rope_scaling` into one `rope_parameters` dict.

    Models with per-layer-type RoPE (Gemma 3: `{"full_attention": {...}, "sliding_attention": {...}}`)
    nest one dict per layer type; the full-attention one is the model's global RoPE, the value
    transformers 4 kept in `rope_theta`.
    """
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, Mapping):
        return None
    if "rope_theta" not in params and isinstance(params.get("full_attention"), Mapping):
        return params["full_attention"]
    return params


def rope_theta(config: Any) -> float:
    """The RoPE base of an HF config: `rope_parameters["rope_theta"]` (5.x) or `rope_theta` (4.x)."""
    params = _rope_parameters(config)
    if params is not None and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    # transformers 5 raises AttributeError for `rope_theta`: getattr's default covers both versions.
    theta = getattr(config, "rope_theta", None)
    return float(theta) if theta is not None else DEFAULT_ROPE_THETA


def rope_scaling(config: Any) -> dict[str, Any] | None:
    """Non-default RoPE scaling (YaRN, llama3, ...) of an HF config, or None for plain RoPE.

    transformers 5.0: `rope_parameters` always exists (`rope_type: "default"` for plain RoPE) and
    `rope_scaling` is an alias of it, so a truthy `rope_scaling` no longer means scaled RoPE.
    """
    params = _rope_parameters(config)
    if params is None:
        scaling = getattr(config, "rope_scaling", None)
        return dict(scaling) if scaling else None
    if params.get("rope_type", params.get("type", "default")) == "default":
        return None
    return {k: v for k, v in params.items() if k != "rope_theta"}


def config_dtype(config: Any) -> Any:
    """The dtype an HF config records: `dtype` (4.56 renamed it; 5.x warns on `torch_dtype`)."""
    return getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)


@contextmanager
def quiet_progress() -> Iterator[None]:
    """No transformers progress bars inside the block (restored after).

    transformers 5.0 draws a tqdm bar on stderr for every `save_pretrained` ("Writing model
    shards") and `from_pretrained` ("Loading weights"), even of a one-file model; 4.x drew one
    only for sharded checkpoints. The switch is process-wide (it also hides hub download bars),
    so use it only around local work that is quick anyway.
    """
    with importing_transformers():
        from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


@contextmanager
def quiet_gguf_conversion() -> Iterator[None]:
    """No "Converting and de-quantizing GGUF tensors" bar inside the block (restored after).

    transformers (4.x and 5.x) draws it with the `tqdm.auto.tqdm` its `modeling_gguf_pytorch_utils` imports,
    not with its own `logging.tqdm`, so `quiet_progress` does not reach it, and TQDM_DISABLE is read
    only when tqdm is imported: that module's `tqdm` is bound to a disabled one while the block runs.
    Process-wide like `quiet_progress`: hold a lock around it if other threads load GGUF files.
    """
    with importing_transformers():
        from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
