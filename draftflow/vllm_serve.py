"""Serve an exported drafter with vLLM's speculative decoding and measure what a server would see.

`serve_with_vllm` starts a `vllm.LLM` on the target with the export as its
`speculative_config`, decodes the prompts greedily, and reads vLLM's own
speculative-decoding counters: mean acceptance length = 1 + accepted / drafts
(vLLM's definition; the same quantity as draftflow's τ, tokens per target step),
and P(at least k drafts accepted) from the per-position counts. The evaluate stage
compares the tokens with the target's greedy output (lossless) and vLLM's τ with
draftflow's own on the same prompts: a gap means training and serving disagree
(taps, mask token, layer ids, attention rules), the quiet failure this check exists for.

Does not know: stores, stages or how the export was made; it needs vLLM (imported
lazily through `draftflow.engines.vllm`). Trade-off: one engine start per export
(minutes on CPU), so the stage serves the exports of the run's own drafter kind only.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftflow.config import VLLMEngineConfig
from draftflow.errors import ConfigError

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class ServedResult:
    """What vLLM did with one export: its tokens per prompt and its acceptance counters."""

    export: str
    tokens: list[list[int]]
    tau: float | None
    acceptance_rate: list[float]
    drafts: int
    accepted: int


def speculative_config(export_dir: str | Path) -> dict[str, Any]:
    """vLLM's `speculative_config` for an export folder: method and draft count as its config.json says
    (DFlash: block_size - 1; EAGLE-3: its chain depth), the same as the folder's README serve line.

    Raises:
        ConfigError: the folder has no config.json; StoreError: it is no draftflow export.
    """
    from draftflow.export_readme import speculative_settings

    path = Path(export_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"no drafter export at {export_dir} (config.json missing); run the train stage first")
    method, tokens = speculative_settings(json.loads(path.read_text()))
    return {"method": method, "model": str(export_dir), "num_speculative_tokens": tokens}


def _counters(llm: Any) -> tuple[int, int, list[int]]:
    """(drafts, accepted draft tokens, accepted per draft position) from vLLM's metrics."""
    drafts = accepted = 0
    per_pos: list[int] = []
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            drafts += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            accepted += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = [a + int(b) for a, b in zip(per_pos or [0] * len(m.values), m.values)]
    return drafts, accepted, per_pos


def serve_with_vllm(target_path: str, export_dir: str | Path, prompts: list[list[int]], max_new_tokens: int,
                    stop_ids: list[int],
                    vcfg: VLLMEngineConfig, dtype: str = "auto") -> ServedResult:
    """Greedy speculative decoding of `prompts` in vLLM with the drafter at `export_dir`.

    Raises:
        DraftflowError: vLLM is missing; ConfigError: no export there, or (on CPU) an unsupported head size.
    """
    from draftflow.engines.vllm import (
        check_head_size,
        engine_kwargs,
        import_vllm,
        prepare_environment,
        release_engines,
        shutdown_llm,
    )

    vllm = import_vllm()
    spec = speculative_config(export_dir)
    check_head_size(target_path)
    check_head_size(str(export_dir), what="drafter export")
    prepare_environment(vcfg)
    release_engines()  # a generation or capture engine of this process would hold the memory
    llm = vllm.LLM(model=target_path, speculative_config=spec, disable_log_stats=False,
                   **engine_kwargs(vcfg, target_path, dtype))
    try:
        params = vllm.SamplingParams(max_tokens=max_new_tokens, temperature=0.0, stop_token_ids=list(stop_ids),
                                     detokenize=False)
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        drafts, accepted, per_pos = _counters(llm)
    finally:
        shutdown_llm(llm)
    tau = 1.0 + accepted / drafts if drafts else None
    rate = [a / drafts for a in per_pos] if drafts else []
    log.info("vLLM served %s: tau %s over %d drafting steps", export_dir, f"{tau:.3f}" if tau else "n/a", drafts)
    return ServedResult(str(export_dir), tokens, tau, rate, drafts, accepted)
