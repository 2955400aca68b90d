"""Self-instruct prompts: the target writes the user prompts of a curate source.

The user turn's header is taken from the target's own chat template: a conversation
[system?, user: <sentinel>] is rendered and cut before the sentinel (ChatML gives
"<|im_start|>user\\n" after any default system prompt, Llama 3 "...<|start_header_id|>user
<|end_header_id|>\\n\\n"), so any template works without being known here. Sampling from
that header makes the target write what its users ask. The completions are cleaned
(stripped; empty ones, ones cut at max_new_tokens and ones holding an added token dropped;
capped at max_chars; exact and near duplicates dropped) and the first `count` are written as
a prompt-format JSONL file (`{"prompt": ...}` per line) into the cache, named by a key of
all that decides its content: the target's fingerprint, the config, the engine, this
module's source. A file already there is reused, never regenerated.

Determinism: every batch and request seed derives from (seed, round, index), so one machine
gives the same file for the same key. Sampling runs in rounds sized by the yield seen so far
and stops after MAX_ROUNDS: a target that seldom ends its turn gives fewer prompts (a
warning), never an endless loop. This module knows nothing of curate (which reads the file
like any `format: prompt` source) nor of Prefect.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path

import numpy as np

from draftflow.chat.format import ChatFormat
from draftflow.config import RegenerateConfig, SelfInstructConfig, TargetConfig
from draftflow.data import dedup
from draftflow.engines import Completion, Engine, GenRequest, SamplingParams, make_engine
from draftflow.errors import ConfigError, DraftflowError
from draftflow.kept import default_cache_dir
from draftflow.store import digest, write_local_atomic
from draftflow.target import TargetRef

log = logging.getLogger(__name__)
SENTINEL = "DRAFTFLOW-SELF-INSTRUCT-SENTINEL"
MARGIN = 0.25  # sample this much more than the prompts still missing, over the yield seen so far
MAX_ROUNDS = 8
MIN_YIELD = 0.05  # a round samples at most 1 / MIN_YIELD times the prompts still missing
MIN_ROUND = 64  # and at least this many (a generate call costs about the same for a few rows or 64)
NEAR_DUP = 0.8  # MinHash Jaccard (word 3-grams) at which a prompt is a near duplicate of an earlier one
NGRAM = 3
# Requests per generate call: fixed, not regenerate.batch_size, since the hf engine seeds per batch (the file's
# key must decide its content); vLLM seeds per request and batches inside.
BATCH = {"hf": 64, "vllm": 4096}


def user_header(fmt: ChatFormat, system: str | None) -> str:
    """The target's rendering of a conversation up to where the first user message's text starts.

    Raises:
        ConfigError: the template does not render a user message's text verbatim.
    """
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": SENTINEL}]
    text = fmt.render(messages)
    if SENTINEL not in text:
        raise ConfigError("the target's chat template does not render a user message as written, so a "
                          "self_instruct source cannot find the user turn's header; use a path source instead")
    return text[:text.index(SENTINEL)]


def engine_name(rcfg: RegenerateConfig) -> str:
    """The engine that samples: vllm when regenerate uses it on a GPU, else hf (HTTP chat endpoints cannot continue
    raw ids, and vLLM's CPU build cannot seed a request: its worker dies with "CPU Generator does not use offset")."""
    import torch

    return "vllm" if rcfg.engine == "vllm" and torch.cuda.is_available() else "hf"


def file_key(cfg: SelfInstructConfig, target_fp: str, engine: str) -> str:
    """What names the prompts file: everything that decides its content."""
    code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    return digest({"target": target_fp, "config": cfg.model_dump(mode="json"), "engine": engine, "code": code})[:32]


def prompts_file(cfg: SelfInstructConfig, target: TargetRef, tcfg: TargetConfig, rcfg: RegenerateConfig,
                 cache_dir: Path | None = None) -> str:
    """The local path of the prompts file for this config and target, generated unless the cache holds it.

    Args:
        tcfg: the target's section (dtype, device, revision of the engine).
        rcfg: the regenerate section (its engine and vLLM settings).

    Raises:
        DraftflowError: the target wrote no usable prompt.
    """
    name = engine_name(rcfg)
    path = Path(cache_dir or default_cache_dir()) / "self_instruct" / f"{file_key(cfg, target.fingerprint, name)}.jsonl"
    if path.is_file():
        return str(path)
    fmt = ChatFormat.from_pretrained(target.path)
    ids = fmt.tokenize([user_header(fmt, cfg.system)])[0]
    banned = tuple(sorted({*fmt.tokenizer.get_added_vocab(), *fmt.tokenizer.all_special_tokens} - {""}))
    engine = make_engine(rcfg.model_copy(update={"engine": name}), target.path, tcfg.dtype, tcfg.device,
                         tcfg.revision)
    try:
        prompts = sample_prompts(engine, ids, cfg, BATCH[name], banned)
    finally:
        engine.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    body = "".join(json.dumps({"prompt": p}, ensure_ascii=False) + "\n" for p in prompts)
    write_local_atomic(path, lambda tmp: Path(tmp).write_text(body, encoding="utf-8"))
    log.info("self_instruct: %d prompts by %s (%s) in %s", len(prompts), target.path, name, path)
    return str(path)


def sample_prompts(engine: Engine, prompt_ids: list[int], cfg: SelfInstructConfig, batch_size: int,
                   banned: tuple[str, ...] = ()) -> list[str]:
    """Sample from the user header in rounds until `cfg.count` prompts survive `clean` (or MAX_ROUNDS)."""
    done: list[Completion] = []
    kept: list[str] = []
    for rnd in range(MAX_ROUNDS):
        missing = cfg.count - len(kept)
        if missing <= 0:
            break
        rate = max((len(kept) + 1) / (len(done) + 1), MIN_YIELD)  # the yield so far, never 0
        n = max(MIN_ROUND, math.ceil(missing * (1 + MARGIN) / rate))
        done += _sample(engine, prompt_ids, cfg, rnd, n, batch_size)
        kept = clean(done, cfg.max_chars, banned)
    if not kept:
        raise DraftflowError(f"self_instruct: the target wrote no usable prompt in {len(done)} samples (each was "
                             "cut at max_new_tokens, empty or a copy); raise self_instruct.max_new_tokens")
    if len(kept) < cfg.count:
        log.warning("self_instruct: %d of %d prompts after %d samples", len(kept), cfg.count, len(done))
    return kept[:cfg.count]


def _seed(*parts: int) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "big") >> 1


def _sample(engine: Engine, prompt_ids: list[int], cfg: SelfInstructConfig, rnd: int, n: int,
            batch_size: int) -> list[Completion]:
    """`n` completions of round `rnd`, each request with its own seed (the batch's differs per batch too)."""
    out: list[Completion] = []
    for start in range(0, n, batch_size):
        size = min(batch_size, n - start)
        params = SamplingParams(cfg.max_new_tokens, cfg.temperature, cfg.top_p, seed=_seed(cfg.seed, rnd, start, -1))
        requests = [GenRequest(messages=[], prompt_ids=list(prompt_ids), seed=_seed(cfg.seed, rnd, start + i))
                    for i in range(size)]
        out += engine.generate(requests, params)
    return out


def clean(completions: list[Completion], max_chars: int, banned: tuple[str, ...] = ()) -> list[str]:
    """The usable prompts among completions, in order: stripped; empty ones, ones cut at max_new_tokens
    (finish_reason "length") and ones holding a `banned` string (the target's added tokens, e.g. <|im_start|>:
    they would change the conversation's structure when rendered) dropped; capped at `max_chars`; exact, then near
    duplicates (MinHash, NEAR_DUP) of an earlier prompt dropped."""
    texts = [c.text.strip()[:max_chars].strip() for c in completions if c.finish_reason == "stop"]
    texts = [t for t in texts if t and not any(b in t for b in banned)]
    first = dedup.first_occurrence(np.array([dedup.key64(" ".join(t.split())) for t in texts], np.uint64))
    texts = [t for t, keep in zip(texts, first) if keep]
    if len(texts) < 2:
        return texts
    sigs = np.frombuffer(b"".join(dedup.signature(t, NGRAM) for t in texts), "<u4").reshape(len(texts), -1)
    near = dedup.near_duplicates(sigs, NEAR_DUP)[0]
    return [t for t, dup in zip(texts, near) if not dup]
