"""Tokenize-stage throughput against the raw cost of rendering and tokenizing, same run.

Synthetic multi-turn conversations (system prompts, 1-4 turns, code, some
reasoning) go through the stage path (`draftflow.stages.tokenize.encode_rows`:
render + mask + encode + truncation + counts) with the real Qwen3 tokenizer and
template, and through the raw baseline: render each conversation once with
`apply_chat_template(tokenize=False)` and one batched `tokenizer(texts)` call,
no mask. Every policy (`last_turn`, `auto`, `per_turn`) runs on both paths: ids
handed over by regenerate (the pipeline's path) and ids derived from the template.

The ratio is tokens/s of the stage's output rows over tokens/s of the raw baseline:
`per_turn` and `auto` emit ~2.5 rows per conversation (each with its own history), so
their conversations/s is lower by design while their tokens/s is what the work costs.
Times are the best of `--repeats` runs, raw and stage runs interleaved, taken both as this
process's CPU time (`time.process_time`: on a shared, loaded machine it counts only this
benchmark's work; the headline) and as wall-clock time. A second baseline line renders and
tokenizes with draftflow's own calls (`Renderer`, `tokenize_texts`), to show how much of
the lead comes from cheaper calls rather than from less work.

Usage: python -m benchmarks.tokenize [--conversations 10000] [--repeats 3]
       [--policies last_turn,auto,per_turn] [--tokenizer tests/fixtures/tokenizers/qwen3]
       [--chat-template tests/fixtures/chat_templates/<name>.jinja]
"""

from __future__ import annotations

import os
import sys

# This file's name shadows the standard library's `tokenize` when run as a script;
# drop its folder from the import path before anything imports `tokenize`.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

from draftflow.config import TokenizeConfig  # noqa: E402
from draftflow.stages.tokenize import encode_rows  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORDS = (
    "the model reads every token once and the drafter guesses the next few tokens so the server "
    "can verify a whole block in one pass which makes decoding faster when guesses are good"
).split()
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
    return {
        "sample_id": f"c{i}",
        "source": "synthetic",
        "messages": messages,
        "generated": None,
        "enable_thinking": True,
    }


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


class Timings:
    """Best-of-N CPU and wall seconds per measured path, with the output of the last run."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}
        self.out: dict[str, tuple[int, int]] = {}  # (tokens, rows)

    def run(self, label: str, fn: Callable[[], tuple[int, int]]) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        self.out[label] = fn()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        self.cpu[label] = min(cpu, self.cpu.get(label, cpu))
        self.wall[label] = min(wall, self.wall.get(label, wall))


def raw(rows: list[dict], tokenizer) -> tuple[int, int]:
    texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in rows]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return sum(len(x) for x in ids), len(ids)


def raw_draftflow_calls(rows: list[dict], path: str) -> tuple[int, int]:
    from draftflow.chat.tokens import tokenize_texts
    from draftflow.stages.tokenize import _chat

    chat = _chat(path)
    texts = [chat.renderer.render(r["messages"], False, chat.template_kwargs) for r in rows]
    ids = tokenize_texts(chat.tokenizer, texts)
    return sum(len(x) for x in ids), len(ids)


def stage(rows: list[dict], path: str, tcfg: TokenizeConfig) -> tuple[int, int]:
    res = encode_rows(rows, path, tcfg, 1)
    return sum(len(r["input_ids"]) for r in res["rows"]), len(res["rows"])


def measure(rows: list[dict], args: argparse.Namespace) -> Timings:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    data = {"ids from regenerate": attach_generated(rows, args.tokenizer), "ids from template": rows}
    paths = [
        (f"{policy} {label}", data[label], TokenizeConfig(max_length=8192, policy=policy, min_supervised_tokens=1))
        for label in data
        for policy in args.policies.split(",")
    ]
    stage(rows[:50], args.tokenizer, paths[0][2])  # load the tokenizer outside the timing
    raw(rows[:50], tokenizer)
    timings = Timings()
    for _ in range(args.repeats):  # interleaved, so a burst of load hits every path alike
        timings.run(RAW, lambda: raw(rows, tokenizer))
        timings.run(RAW_FAST, lambda: raw_draftflow_calls(rows, args.tokenizer))
        for label, conversations, tcfg in paths:
            timings.run(label, lambda c=conversations, t=tcfg: stage(c, args.tokenizer, t))
    return timings


def with_template(folder: str, template: Path) -> str:
    """A temporary copy of the tokenizer folder whose tokenizer_config.json carries `template`."""
    out = Path(tempfile.mkdtemp(prefix="tokenize-bench-"))
    for f in Path(folder).iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = template.read_text()
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return str(out)


RAW, RAW_FAST = "raw render+tokenize (baseline)", "raw, draftflow's calls"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=10000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokenizer", default=str(ROOT / "tests/fixtures/tokenizers/qwen3"))
    ap.add_argument("--policies", default="last_turn,auto,per_turn")
    ap.add_argument(
        "--chat-template",
        help="a Jinja file to use instead of the tokenizer's own template, "
        "e.g. tests/fixtures/chat_templates/Qwen-Qwen2.5-7B-Instruct.jinja (prefix-stable: auto merges turns)",
    )
    args = ap.parse_args()
    if args.chat_template:
        args.tokenizer = with_template(args.tokenizer, Path(args.chat_template))
    rng = random.Random(0)
    rows = [conversation(rng, i) for i in range(args.conversations)]
    n, load = len(rows), os.getloadavg()[0]
    timings = measure(rows, args)
    print(
        f"{n} conversations, {sum(len(r['messages']) for r in rows)} messages; best of {args.repeats}; "
        f"load average {load:.1f} at start, {os.getloadavg()[0]:.1f} at end, {os.cpu_count()} cores"
    )
    print("ratio = tokens/s of the output rows / tokens/s of the raw baseline (CPU time; wall time beside it)")
    base_tokens = timings.out[RAW][0]
    for label in timings.cpu:
        tokens, seqs = timings.out[label]
        cpu, wall = timings.cpu[label], timings.wall[label]
        ratio_cpu = (tokens / cpu) / (base_tokens / timings.cpu[RAW])
        ratio_wall = (tokens / wall) / (base_tokens / timings.wall[RAW])
        name = label if label.startswith("raw") else f"stage {label}"
        print(
            f"{name:<36}: {n / cpu:7.0f} conv/s {tokens / cpu:9.0f} tok/s {seqs:6d} rows  "
            f"ratio {ratio_cpu:.2f} (wall {ratio_wall:.2f})"
        )


if __name__ == "__main__":
    main()
