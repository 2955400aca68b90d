"""Capture engines: the target's hidden states at the drafter's taps, per sequence.

An engine turns a batch of token id lists into one (T_i, n_taps, D) tensor per
sequence (on the CPU, in the target's dtype), tap i being DFlash id
`layer_ids[i]`, the output of decoder layer L (`draftflow.layers`), or for
`layers.FINAL` the target's final normed hidden state (hf engine only).

- `HFCapture` (transformers): forward hooks on the tap layers only, so the other
  layers' outputs are never kept; the forward stops right after the last tap
  layer (its hook raises a private exception that `capture` catches), so deep
  layers, the final norm and the LM head are skipped. Batches are right-padded:
  in a causal model padding never changes the valid positions. bf16 on GPU
  comes from how the target is loaded (`draftflow.target.load_target`).
- `VLLMCapture`: vLLM's hidden-state extraction (vLLM >= 0.18: the
  `extract_hidden_states` speculative method with `ExampleHiddenStatesConnector`,
  which writes one safetensors file per request). The file is written
  asynchronously, in a later engine step than the one that returns the request:
  the writer holds an exclusive flock on `<path>.lock` until the file is complete,
  so `read_hidden_states` takes a shared lock on it (with a deadline) before
  reading. vLLM marks the connector as an example and its layout may move between
  releases; the `make test-vllm` leg checks it against HF on vLLM's CPU build.
  vLLM is imported lazily.

`capture_in_batches` runs any engine over length-sorted batches and halves the
batch on CUDA out-of-memory. This module knows nothing of stores or shards.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import logging
import math
import os
import shutil
import tempfile
import threading
import time
from typing import Protocol

import torch

from draftflow.errors import ConfigError, DraftflowError
from draftflow.layers import FINAL, engine_layer_index
from draftflow.target import model_lock

log = logging.getLogger(__name__)


class CaptureEngine(Protocol):
    name: str
    layer_ids: list[int]

    def capture(self, batch: list[list[int]]) -> list[torch.Tensor]:
        """One (T_i, n_taps, D) CPU tensor per sequence of `batch`."""
        ...


class _StopForward(Exception):
    """Raised by the last tap's hook: everything after it is not needed."""


def decoder_layers(model) -> tuple[torch.nn.Module, torch.nn.ModuleList]:
    """(decoder body without the LM head, its list of decoder layers) of an HF causal LM."""
    body = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(body, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ConfigError(f"cannot find the decoder layers of {type(model).__name__} (expected .model.layers); "
                          "set extract.engine to a supported engine or use a Llama/Qwen-style target")
    return body, layers


def right_pad(batch: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), both (B, T_max), padded on the right with id 0 / mask 0."""
    width = max(len(x) for x in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, x in enumerate(batch):
        ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
        mask[i, : len(x)] = 1
    return ids.to(device), mask.to(device)


class HFCapture:
    """Tap capture from a transformers model with forward hooks on the tap layers only."""

    name = "hf"

    def __init__(self, model, layer_ids: list[int]):
        self.model, self.layer_ids = model, list(layer_ids)
        self.body, self.layers = decoder_layers(model)
        self.device = model.get_input_embeddings().weight.device

    def _hook(self, slot: int, taps: dict[int, torch.Tensor], last: bool):
        def hook(module, args, output):
            taps[slot] = output[0] if isinstance(output, tuple) else output  # (B, T, D)
            if last:
                raise _StopForward
        return hook

    def _module(self, layer_id: int) -> torch.nn.Module:
        """The module whose output is feature `layer_id`: decoder layer L, or the final norm for FINAL."""
        if layer_id == FINAL:
            norm = getattr(self.body, "norm", None)
            if not isinstance(norm, torch.nn.Module):
                raise ConfigError(f"cannot find the final norm of {type(self.model).__name__} (expected "
                                  ".model.norm), needed by drafter.kind=eagle3; use a Llama/Qwen-style target")
            return norm
        return self.layers[engine_layer_index("hf_hook", layer_id)]

    @torch.no_grad()
    def capture(self, batch: list[list[int]]) -> list[torch.Tensor]:
        ids, mask = right_pad(batch, self.device)
        taps: dict[int, torch.Tensor] = {}
        # The final norm (FINAL) runs after every decoder layer, so it is last when present.
        last = max(range(len(self.layer_ids)), key=lambda s: math.inf if self.layer_ids[s] == FINAL
                   else self.layer_ids[s])
        # Hooks are added and removed under the model's lock: threads share the cached model.
        with model_lock(self.model):
            handles = [self._module(lid).register_forward_hook(self._hook(slot, taps, slot == last))
                       for slot, lid in enumerate(self.layer_ids)]
            try:
                self.body(input_ids=ids, attention_mask=mask, use_cache=False)
            except _StopForward:
                pass
            finally:
                for h in handles:
                    h.remove()
        stacked = torch.stack([taps[s] for s in range(len(self.layer_ids))], dim=2)  # (B, T, n_taps, D)
        return [stacked[i, : len(x)].to("cpu") for i, x in enumerate(batch)]


class CaptureTimeout(DraftflowError):
    """vLLM did not finish writing a request's hidden states in time."""


def _try_shared_lock(lock_path: str) -> int | None:
    """An fd holding a shared flock on `lock_path`, or None while the file is missing or exclusively locked."""
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return fd
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return None
        raise


def read_hidden_states(path: str, timeout_s: float, poll_s: float = 0.01) -> torch.Tensor:
    """The `hidden_states` tensor vLLM's connector wrote to `path`, once its writer is done.

    The writer holds an exclusive flock on `<path>.lock` from before the request returns until the
    file is complete; a shared lock here is granted only after that. Both files are removed after.

    Raises:
        CaptureTimeout: the lock was not released within `timeout_s` (one line, naming the file).
    """
    from safetensors.torch import load_file

    lock_path, deadline = path + ".lock", time.monotonic() + timeout_s
    while (fd := _try_shared_lock(lock_path)) is None:
        if time.monotonic() > deadline:
            raise CaptureTimeout(f"vLLM did not finish writing hidden states {path} within {timeout_s:g} s; "
                                 "raise regenerate.vllm.capture_timeout_s if the engine is just slow")
        time.sleep(poll_s)
    try:
        hidden = load_file(path, device="cpu")["hidden_states"]
    finally:
        os.close(fd)
    for p in (path, lock_path):
        if os.path.exists(p):
            os.remove(p)
    return hidden


class VLLMCapture:
    """Tap capture with vLLM's hidden-state extraction (see the module doc)."""

    name = "vllm"

    def __init__(self, path: str, layer_ids: list[int], vcfg, dtype: str = "auto"):
        if FINAL in layer_ids:
            raise ConfigError("drafter.kind=eagle3 stores the target's final normed hidden state, which the vllm "
                              "capture engine cannot extract yet; set extract.engine=hf")
        from draftflow.engines.vllm import check_head_size, engine_kwargs, import_vllm, prepare_environment

        self._vllm = import_vllm()
        check_head_size(path)
        prepare_environment(vcfg)
        self.layer_ids, self.timeout_s = list(layer_ids), vcfg.capture_timeout_s
        self._lock = threading.Lock()  # shard tasks share the engine; vLLM's LLM is not thread-safe
        self._dir = tempfile.mkdtemp(prefix="draftflow-vllm-hidden-")
        aux = [engine_layer_index("vllm", lid) for lid in self.layer_ids]
        connector = {"kv_connector": "ExampleHiddenStatesConnector"}
        if vcfg.hidden_states_connector:
            module, _, cls = vcfg.hidden_states_connector.partition(":")
            connector = {"kv_connector": cls, "kv_connector_module_path": module}
        self.llm = self._vllm.LLM(
            model=path, **engine_kwargs(vcfg, path, dtype),
            enable_prefix_caching=False,  # a cached prefix would not be captured
            enable_chunked_prefill=False,  # required by the extraction method
            speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": aux}}},
            kv_transfer_config={**connector, "kv_role": "kv_producer",
                                "kv_connector_extra_config": {"shared_storage_path": self._dir}})

    def capture(self, batch: list[list[int]]) -> list[torch.Tensor]:
        params = self._vllm.SamplingParams(max_tokens=1, detokenize=False)
        with self._lock:
            outs = self.llm.generate([{"prompt_token_ids": list(x)} for x in batch], params, use_tqdm=False)
        return [self._read(o, len(x)) for o, x in zip(outs, batch)]

    def _read(self, out, length: int) -> torch.Tensor:
        path = (getattr(out, "kv_transfer_params", None) or {}).get("hidden_states_path")
        if not path:
            raise DraftflowError("vLLM returned no hidden_states_path: the vllm capture engine needs vLLM >= 0.18 "
                                 "(extract_hidden_states); set extract.engine=hf otherwise")
        hidden = read_hidden_states(path, self.timeout_s)
        if hidden.shape[0] != length and hidden.shape[1] == length:  # (n_taps, T, D) in some releases
            hidden = hidden.transpose(0, 1)
        assert hidden.shape[0] >= length and hidden.shape[1] == len(self.layer_ids), tuple(hidden.shape)
        return hidden[:length].contiguous()

    def close(self) -> None:
        """Shut vLLM down (its GPU memory is freed) and remove the exchange folder."""
        from draftflow.engines.vllm import forget_engine, shutdown_llm

        llm, self.llm = self.llm, None
        forget_engine(self)
        shutdown_llm(llm)
        shutil.rmtree(self._dir, ignore_errors=True)


def release_capture_engines() -> None:
    """Close this process's vLLM engines (capture or generation), so that training in child processes
    gets the GPU."""
    from draftflow.engines.vllm import release_engines

    release_engines()


def make_capture_engine(engine: str, target_path: str, layer_ids: list[int], dtype: str = "auto",
                        device: str = "auto", vllm_cfg=None) -> CaptureEngine:
    """The configured engine (loaded once per process): `hf` or `vllm` (with a `VLLMEngineConfig`)."""
    if engine == "hf":
        from draftflow.target import load_target

        model, _ = load_target(target_path, dtype, device)
        return HFCapture(model, layer_ids)
    if engine == "vllm":  # one per process (shared_engine), loaded on the first shard
        from draftflow.engines.vllm import shared_engine

        key = ("capture", target_path, tuple(layer_ids), vllm_cfg.model_dump_json(), dtype)
        return shared_engine(key, lambda: VLLMCapture(target_path, list(layer_ids), vllm_cfg, dtype))
    raise ConfigError(f"extract.engine must be hf or vllm, got {engine!r}")


def _free_cuda() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def capture_in_batches(engine: CaptureEngine, seqs: list[list[int]],
                       batch_size: int) -> tuple[list[torch.Tensor], int]:
    """Features of every sequence, in input order, from length-sorted batches.

    On CUDA out-of-memory the batch is retried at half size (down to 1, then the error is
    raised), and the smaller size is kept for the rest of the call.

    Returns:
        (one (T_i, n_taps, D) tensor per sequence, the batch size that last succeeded)
    """
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out: list[torch.Tensor | None] = [None] * len(seqs)
    pos = 0
    while pos < len(order):
        idx = order[pos:pos + batch_size]
        try:
            feats = engine.capture([seqs[i] for i in idx])
        except torch.cuda.OutOfMemoryError:
            if batch_size == 1:
                raise
            batch_size = max(1, batch_size // 2)
            log.warning("CUDA out of memory on %d sequences; retrying at batch size %d", len(idx), batch_size)
            feats = None
        if feats is None:
            _free_cuda()  # outside the except block, so the failed batch's tensors are gone
            continue
        for i, f in zip(idx, feats):
            out[i] = f
        pos += len(idx)
    return out, batch_size  # type: ignore[return-value]
