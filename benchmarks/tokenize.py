"""Tokenize-stage throughput against the raw cost of rendering and tokenizing, same run.

Synthetic multi-turn conversations (system prompts, 1-4 turns, code, some
reasoning) go through the stage path (`draftflow.stages.tokenize.encode_rows`:
render + mask + encode + truncation + counts) with the real Qwen3 tokenizer and
template, and through the raw baseline: render each conversation once with
`apply_chat_template(tokenize=False)` and one batched `tokenizer(texts)` call,
no mask. Prints conversations/s and tokens/s for each, and stage/raw.
The one-row-per-conversation policy (`last_turn`) with the target's ids handed over by
regenerate (the pipeline's path) is the headline ratio; the template-derived path and the
`auto` and `per_turn` policies are reported beside it (their output grows with turns).

Usage: python benchmarks/tokenize.py [--conversations 10000] [--tokenizer tests/fixtures/tokenizers/qwen3]
"""

from __future__ import annotations

import os
import sys

# This file's name shadows the standard library's `tokenize` when run as a script;
# drop its folder from the import path before anything imports `tokenize`.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import argparse  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from draftflow.config import TokenizeConfig  # noqa: E402
from draftflow.stages.tokenize import encode_rows  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the model reads every token once and the drafter guesses the next few tokens so the server "
         "can verify a whole block in one pass which makes decoding faster when guesses are good").split()
CODE = "def add(a, b):\n    return a + b\n\nfor i in range(3):\n    print(add(i, i))\n"


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))).capitalize() + "."


def conversation(rng: random.Random, i: int) -> dict:
    messages = []
    if rng.random() < 0.4:
        messages.append({"role": "system", "content": "You are a concise assistant."})
    for _ in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": _text(rng, 8, 40)})
        answer = _text(rng, 20, 120) + ("\n\n```python\n" + CODE + "```" if rng.random() < 0.3 else "")
        reasoning = _text(rng, 10, 60) if rng.random() < 0.3 else None
        messages.append({"role": "assistant", "content": answer, "reasoning_content": reasoning})
    return {"sample_id": f"c{i}", "source": "synthetic", "messages": messages, "generated": None,
            "enable_thinking": True}


def attach_generated(rows: list[dict], path: str) -> list[dict]:
    """Rows as the regenerate stage hands them over: each assistant turn's generated ids.

    The ids are what the target would have produced after the serving prompt (derived
    once here, outside the timing), so the stage supervises them verbatim.
    """
    from draftflow.stages.tokenize import _chat

    chat, out = _chat(path), []
    for r in rows:
        msgs, gen = r["messages"], []
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                ids = chat.completion_ids(msgs[:i], m, enable_thinking=True)
                gen.append({"turn": i, "ids": ids})
        out.append({**r, "generated": gen})
    return out


def time_raw(rows: list[dict], tokenizer) -> tuple[float, int]:
    start = time.perf_counter()
    texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in rows]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return time.perf_counter() - start, sum(len(x) for x in ids)


def time_stage(rows: list[dict], path: str, policy: str) -> tuple[float, int, int]:
    tcfg = TokenizeConfig(max_length=8192, policy=policy, min_supervised_tokens=1)
    encode_rows(rows[:50], path, tcfg, 1)  # load the tokenizer outside the timing
    start = time.perf_counter()
    res = encode_rows(rows, path, tcfg, 1)
    return time.perf_counter() - start, sum(len(r["input_ids"]) for r in res["rows"]), len(res["rows"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=10000)
    ap.add_argument("--tokenizer", default=str(ROOT / "tests/fixtures/tokenizers/qwen3"))
    ap.add_argument("--policies", default="last_turn,auto,per_turn")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    rng = random.Random(0)
    rows = [conversation(rng, i) for i in range(args.conversations)]
    raw_s, raw_tokens = time_raw(rows, AutoTokenizer.from_pretrained(args.tokenizer))
    n = len(rows)
    print(f"{n} conversations, {sum(len(r['messages']) for r in rows)} messages")
    print(f"raw   render+tokenize          : {n / raw_s:7.0f} conv/s {raw_tokens / raw_s:9.0f} tok/s  (baseline)")
    # The pipeline's path: regenerate hands over the target's ids, so each turn needs one render.
    # Beside it, the same stage deriving every turn's ids from the template (two renders a turn).
    for label, data in (("ids from regenerate", attach_generated(rows, args.tokenizer)), ("ids from template", rows)):
        for policy in args.policies.split(","):
            s, tokens, seqs = time_stage(data, args.tokenizer, policy)
            print(f"stage {policy:<9} {label:<19}: {n / s:7.0f} conv/s {tokens / s:9.0f} tok/s "
                  f"{seqs:6d} rows  ratio stage/raw {raw_s / s:.2f}")


if __name__ == "__main__":
    main()
