"""Test helper: vLLM's hidden-states connector made to run on vLLM's CPU build.

vLLM 0.32's `ExampleHiddenStatesConnector` copies each finished request's hidden states off
the device with CUDA-only calls (a CUDA stream and event, `pin_memory=True`), which fail on a
machine without an accelerator. This subclass replaces that one method with a plain CPU copy
and keeps everything else, the lock protocol the library reads by included. It lives in the
tests on purpose: the library runs vLLM's connector unchanged, and a CPU test selects this one
through `regenerate.vllm.hidden_states_connector`.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)

PATH = f"{__name__}:CPUHiddenStatesConnector"


class _Done:
    """Stands in for the CUDA event of a finished copy: on CPU the copy is done when it returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        # Slots of the request's blocks, in order: block b holds slots b*S .. b*S+S-1.
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size)[None, :] + blocks[:, None] * self._block_size).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        # The write stays asynchronous, as on GPU: readers must wait on the lock, which is what is tested.
        future = self._executor.submit(self._write_tensors, tensors, _Done(), pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = _Done()
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
