"""transformers engine: batched generation with left padding, CPU or GPU.

For small targets and tests; big runs use vLLM or an HTTP server. Token ids
beyond the tokenizer (embedding padding rows, the DFlash mask id) are
suppressed so a random or undertrained model never emits a non-token.
"""

from __future__ import annotations

import zlib

import torch

from draftflow.engines.base import Completion, GenRequest, SamplingParams
from draftflow.target import eos_token_ids, load_target, model_lock


class HFEngine:
    name = "hf"

    def __init__(self, model, tokenizer, model_id: str):
        self.model, self.tokenizer, self.model_id = model, tokenizer, model_id
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        vocab = model.get_output_embeddings().weight.shape[0]
        self.suppress = list(range(len(tokenizer), vocab))

    @classmethod
    def load(cls, path: str, dtype: str = "auto", device: str = "auto") -> HFEngine:
        model, tokenizer = load_target(path, dtype, device)
        return cls(model, tokenizer, path)

    def close(self) -> None:
        """Nothing to release: the model stays in the process-wide cache."""

    def generate(self, requests: list[GenRequest], params: SamplingParams) -> list[Completion]:
        """Generate for a batch of requests from their serving prompt ids."""
        return self.generate_ids([r.prompt_ids for r in requests], params)

    @torch.no_grad()
    def generate_ids(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Generate for a batch of prompt ids (left-padded to a common length)."""
        width = max(len(p) for p in prompts)
        device = self.model.device
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        sample = params.temperature > 0
        with model_lock(self.model):
            # Under the lock, seeded by (seed, batch content): reproducible, and batches differ.
            torch.manual_seed(zlib.crc32(repr((params.seed, prompts[0], len(prompts))).encode()))
            out = self._generate(ids.to(device), mask.to(device), params, sample)
        return [self._completion(row[width:].tolist(), len(p)) for row, p in zip(out, prompts)]

    def _generate(self, ids, mask, params: SamplingParams, sample: bool):
        return self.model.generate(
            input_ids=ids, attention_mask=mask,
            max_new_tokens=params.max_new_tokens, do_sample=sample,
            temperature=params.temperature if sample else None,
            top_p=params.top_p if sample else None, top_k=params.top_k if sample else None,
            eos_token_id=sorted(self.eos_ids), pad_token_id=self.pad_id,
            suppress_tokens=self.suppress or None,
        )

    def _completion(self, new: list[int], prompt_tokens: int) -> Completion:
        for j, tok in enumerate(new):
            if tok in self.eos_ids:
                ids, reason = new[: j + 1], "stop"
                break
        else:
            ids, reason = new, "length"
        body = ids[:-1] if reason == "stop" else ids
        text = self.tokenizer.decode(body, skip_special_tokens=False)
        return Completion(ids, text, reason, prompt_tokens, completion_tokens=len(ids))
