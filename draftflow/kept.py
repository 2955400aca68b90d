"""Answers kept in the machine's local cache directory, so that a machine computes each once.

A target's or GGUF file's content fingerprint, preflight's checks of a target, the imports of each version of a library
file (`codehash`): each is a string computed from inputs that its key names in full. A leaf module (the code hash,
which the store's fingerprints use, keeps its answers here too).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """Local cache for built targets, downloaded shards and remote work folders."""
    return Path(os.environ.get("DRAFTFLOW_CACHE", Path.home() / ".cache" / "draftflow"))


def kept_answer(folder: str, key: str, compute: Callable[[], str], cache_dir: Path | None = None) -> str:
    """`compute()`'s answer for `key`, kept in the local cache directory (`<folder>/<sha256(key)[:32]>`; `cache_dir`,
    default `default_cache_dir()`) so that a machine computes it once. `key` must hold everything the answer depends
    on. A computation that raises keeps nothing; a cache that cannot be read or written costs the next call the
    computation, no more. Each writer renames its own temporary file into place, so processes and threads that keep
    the same answer at once never show a reader a part of it."""
    known = Path(cache_dir or default_cache_dir()) / folder / hashlib.sha256(key.encode()).hexdigest()[:32]
    try:
        return known.read_text()
    except OSError:
        pass
    answer = compute()
    tmp = known.with_name(f".{known.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        known.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(answer)
        os.replace(tmp, known)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        log.debug("%s not kept in %s: %s", folder, known, exc)
    return answer
