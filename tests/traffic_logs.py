"""Request logs as an OpenAI-compatible server's logger writes them (JSONL of chat-completions requests), for the
refresh tests: prompts made from templates, so each batch is new to the root, plus the bad lines a real log has."""

from __future__ import annotations

import json
import random
from pathlib import Path

TOPICS = ["rivers", "bread", "chess", "volcanoes", "bicycles", "tea", "owls", "bridges", "clocks", "glaciers",
          "kites", "maps", "violins", "tides", "ants", "lighthouses", "paper", "magnets", "coral", "deserts"]
ASKS = ["Explain {t} to a child in two sentences.", "Write a short poem about {t}.", "List three facts about {t}.",
        "Why do people care about {t}?", "Give me a tip about {t}.", "What is the history of {t} in one line?"]
# Traffic that should not help an English drafter: prompts in another script (the tiny target has seen none).
OTHER = ["Расскажи о {t} подробно.", "Почему {t} важны?", "Напиши стихи про {t}.", "Что ты знаешь о {t}?"]


def requests(n: int, seed: int, other_language: bool = False) -> list[dict]:
    """`n` chat-completions requests (some with a logged response, some multi-turn), different per `seed`."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        ask = rnd.choice(OTHER if other_language else ASKS).format(t=rnd.choice(TOPICS))
        row = {"model": "served", "messages": [{"role": "user", "content": f"{ask} ({seed}-{i})"}], "max_tokens": 64}
        if i % 3 == 0:
            row["response"] = {"choices": [{"message": {"role": "assistant", "content": "Here is an answer."}}]}
        if i % 5 == 0:
            row["messages"].insert(0, {"role": "system", "content": "You are brief."})
        out.append(row)
    return out


BAD_LINES = ['{"messages": [{"role": "user", "content": "cut off',  # not JSON (a torn write)
             json.dumps({"messages": [{"role": "system", "content": "only a system prompt"}]}),  # no user turn
             json.dumps({"prompt": "a completions request, not chat"})]  # no messages


def write_log(folder: Path, name: str, rows: list[dict], bad: bool = False) -> Path:
    """One log file of `rows` (and, with `bad`, the three bad lines among them)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r, ensure_ascii=False) for r in rows]
    if bad:
        lines[1:1] = BAD_LINES
    path = folder / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
