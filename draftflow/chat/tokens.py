"""Token ids of many texts in one call, the same ids as `tokenizer(texts)` at less cost.

transformers' `tokenizer(texts, add_special_tokens=False)` on a fast tokenizer is one call into the
Rust `tokenizers.Tokenizer` plus, per text, a conversion to a BatchEncoding (attention mask, offsets)
that the tokenize stage throws away: about a quarter of the tokenizing time on short texts. Here the
backend is called directly when that gives the same ids by construction, else transformers is. And
texts are cut after the added tokens `tokenizers` always splits at (`cut_pattern`), each distinct
piece tokenized once: a conversation's per-turn prompts repeat its history, which is then tokenized
once rather than once per turn.

What it deliberately does not know: any tokenizer's vocabulary or model family; the cut tokens are
derived from the tokenizer's own added vocabulary and settings. The key trade-off: exactness rests
on how transformers drives the backend and on `tokenizers` splitting at added tokens before anything
else (checked by `fast_backend` and `cut_pattern` per tokenizer, and by tests/test_chat_fast.py,
which compares ids with transformers' on every fixture template).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from itertools import chain
from typing import Any

# transformers' own methods between `tokenizer(texts)` and `encode_batch` (4.x and 5.x names)
_CALL_PATH = ("__call__", "_call_one", "_encode_plus", "_batch_encode_plus", "batch_encode_plus")


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
    if any(
        not getattr(type(tokenizer), name).__module__.startswith("transformers.tokenization_utils")
        for name in _CALL_PATH
        if hasattr(type(tokenizer), name)
    ):
        return None  # a tokenizer class that changes the text or ids on the way: let it
    if backend.truncation is not None or backend.padding is not None:
        return None
    split = bool(getattr(tokenizer, "split_special_tokens", False))
    if bool(getattr(backend, "encode_special_tokens", False)) != split:
        return None
    return backend


def tokenize_texts(tokenizer: Any, texts: Sequence[str], direct: bool = True) -> list[list[int]]:
    """Token ids of each text without added special tokens: `tokenizer(texts)["input_ids"]`.

    On the direct path, texts are cut after the added tokens `cut_pattern` allows (a turn's end
    marker) and each distinct piece is tokenized once: the prompts of a conversation's turns repeat
    its history, so per-turn rows cost about one tokenization of the conversation, not one per turn.

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
    pattern = cut_pattern(backend)
    if pattern is None:
        return [e.ids for e in encode(list(texts), add_special_tokens=False)]
    pieces = [_cut(text, pattern) for text in texts]
    distinct = list(dict.fromkeys(p for text in pieces for p in text))
    ids = dict(zip(distinct, (e.ids for e in encode(distinct, add_special_tokens=False)), strict=True))
    return [list(chain.from_iterable(map(ids.__getitem__, text))) for text in pieces]


def _cut(text: str, pattern: re.Pattern[str]) -> list[str]:
    """`text` in pieces, each ending right after a cut token (the last one may not)."""
    parts = pattern.split(text)  # [before, token, before, token, ..., tail]
    out = [parts[i] + parts[i + 1] for i in range(0, len(parts) - 1, 2)]
    return [*out, parts[-1]] if parts[-1] else out


_PATTERNS: dict[tuple[int, int], tuple[Any, re.Pattern[str] | None]] = {}


def cut_pattern(backend: Any) -> re.Pattern[str] | None:
    """A regex of the added tokens after which a text can be cut without changing its ids, or None.

    `tokenizers` splits a text at its added tokens before anything else (normalizer, pre-tokenizer,
    model all run on the pieces between them), so ids(a + b) == ids(a) + ids(b) when `a` ends with
    an added token E that the tokenizer always matches as itself: E is matched on the raw text
    (not `normalized`), takes no whitespace after it (not `rstrip`) and ends in a non-space, no
    added token overlaps E or contains it (leftmost-longest matching then always picks E), no added
    token is `single_word` (its match would depend on the character before it), special tokens are
    not being split (`encode_special_tokens`), and the pre-tokenizer only uses parts that act on
    each piece alone (Metaspace's `prepend_scheme: first` looks at the piece's offset: excluded).
    Computed once per backend and added-vocabulary size.
    """
    key = (id(backend), backend.get_vocab_size(with_added_tokens=True))
    if key not in _PATTERNS:
        _PATTERNS[key] = (backend, _safe_cut_pattern(backend))  # keeps backend alive, so the id stays its
    return _PATTERNS[key][1]


_PIECEWISE_PRE_TOKENIZERS = frozenset(
    {
        "Sequence",
        "Split",
        "ByteLevel",
        "Digits",
        "Whitespace",
        "WhitespaceSplit",
        "Punctuation",
        "BertPreTokenizer",
        "UnicodeScripts",
        "CharDelimiterSplit",
    }
)


def _types(node: Any) -> set[str]:
    if isinstance(node, dict):
        own = {node["type"]} if isinstance(node.get("type"), str) else set()
        return own.union(*(_types(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_types(v) for v in node))
    return set()


def _safe_cut_pattern(backend: Any) -> re.Pattern[str] | None:
    if getattr(backend, "encode_special_tokens", False):
        return None
    pre = backend.pre_tokenizer
    pre = None if pre is None else json.loads(pre.__getstate__())  # its JSON, as in tokenizer.json
    if not _types(pre) <= _PIECEWISE_PRE_TOKENIZERS:
        return None
    added = list(backend.get_added_tokens_decoder().values())
    if any(t.single_word for t in added):
        return None
    raw = [t.content for t in added if not t.normalized and t.content]
    prefixes = {c[:k] for c in raw for k in range(1, len(c))}
    suffixes = {c[-k:] for c in raw for k in range(1, len(c))}

    joined = "\x00".join(raw)  # E has no border (checked first), so count() sees every occurrence

    def safe(e: str) -> bool:
        return (
            not e[-1].isspace()
            and not any(e[k:] in prefixes or e[:k] in suffixes for k in range(1, len(e)))
            and joined.count(e) == 1
        )

    cuts = sorted(
        {t.content for t in added if not t.normalized and not t.rstrip and t.content and safe(t.content)},
        key=len,
        reverse=True,
    )
    if not cuts:
        return None
    return re.compile("(" + "|".join(map(re.escape, cuts)) + ")")
