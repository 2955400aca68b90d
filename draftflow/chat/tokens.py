"""Token ids of many texts in one call, the same ids as `tokenizer(texts)` at less cost.

transformers' `tokenizer(texts, add_special_tokens=False)` on a fast tokenizer is one call into the
Rust `tokenizers.Tokenizer` plus, per text, a conversion to a BatchEncoding (attention mask, offsets)
that the tokenize stage throws away: about a quarter of the tokenizing time on short texts. Here the
backend is called directly when that gives the same ids by construction, else transformers is.

What it deliberately does not know: any tokenizer's vocabulary or rules; the ids come from the
tokenizer itself. The key trade-off: it depends on how transformers drives the backend (checked by
`fast_backend` on every call, and by the golden tests, which compare ids with transformers').
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def fast_backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind a fast HF tokenizer, when calling it directly is exact.

    Besides `encode_batch`, transformers' call turns truncation and padding off (unless asked for
    them) and sets `encode_special_tokens` from `split_special_tokens`. The backend is used only
    when it is already in that state, so its ids are the ones transformers would return.

    Returns:
        The backend, or None (slow tokenizer, or a backend with truncation, padding or split
        special tokens set differently).
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    if not getattr(tokenizer, "is_fast", False) or not hasattr(backend, "encode_batch"):
        return None
    if backend.truncation is not None or backend.padding is not None:
        return None
    split = bool(getattr(tokenizer, "split_special_tokens", False))
    if bool(getattr(backend, "encode_special_tokens", False)) != split:
        return None
    return backend


def tokenize_texts(tokenizer: Any, texts: Sequence[str], direct: bool = True) -> list[list[int]]:
    """Token ids of each text without added special tokens: `tokenizer(texts)["input_ids"]`.

    Args:
        tokenizer: a Hugging Face tokenizer (fast or slow).
        texts: the texts, tokenized in one batched call.
        direct: call the backend when `fast_backend` allows; False always calls transformers.

    Returns:
        One list of ids per text.
    """
    if not texts:
        return []
    backend = fast_backend(tokenizer) if direct else None
    if backend is None:
        return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]
    # encode_batch_fast (tokenizers >= 0.21) skips the character offsets nobody here reads
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return [e.ids for e in encode(list(texts), add_special_tokens=False)]
