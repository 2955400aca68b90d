"""Capture engines equal HF `hidden_states[L + 1]` for every valid DFlash id; OOM halves the batch."""


import pytest
import torch

from draftflow.engines.capture import HFCapture, capture_in_batches
from draftflow.layers import engine_layer_index, hf_hidden_state_index

PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11], [8, 8, 1], [300, 2, 64, 64, 19, 4, 77, 123, 56, 31, 9, 200, 14], [71]]


def _reference(model, prompts):
    """Unbatched HF hidden states per prompt (the ground truth)."""
    with torch.no_grad():
        return [model(torch.tensor([p]), output_hidden_states=True).hidden_states for p in prompts]


def test_engine_indices_are_one_table():
    assert engine_layer_index("hf_hook", 3) == 3  # the decoder layer whose output is the tap
    assert engine_layer_index("hf_hidden", 3) == hf_hidden_state_index(3) == 4
    assert engine_layer_index("vllm", 3) == 4  # vLLM aux ids are boundaries (input of layer k)
    with pytest.raises(ValueError, match="no layer-index convention"):
        engine_layer_index("sglang", 3)


def test_hooks_equal_hidden_states_l_plus_1_for_every_valid_id(target):
    n = target.config.num_hidden_layers
    ids = list(range(n - 1))  # every valid id: 0..N-2 (N-1 is refused, see layers.py)
    ref = _reference(target, PROMPTS)
    got = HFCapture(target, ids).capture(PROMPTS)  # one right-padded batch
    for p, r, g in zip(PROMPTS, ref, got):
        assert g.shape == (len(p), len(ids), target.config.hidden_size)
        for slot, lid in enumerate(ids):
            torch.testing.assert_close(g[:, slot], r[lid + 1][0], atol=1e-5, rtol=1e-5)
            assert not torch.allclose(g[:, slot], r[lid][0], atol=1e-3)  # one layer off differs


def test_forward_stops_after_the_last_tap_and_leaves_no_hooks(target):
    calls = []
    # transformers 5 keeps its own output-recording hook on each layer once output_hidden_states
    # has been used: compare with what was there before rather than expect none.
    before = [list(layer._forward_hooks) for layer in target.model.layers]
    later = [target.model.layers[4], target.model.layers[5], target.model.norm, target.lm_head]
    handles = [m.register_forward_hook(lambda m, a, o, i=i: calls.append(i)) for i, m in enumerate(later)]
    try:
        HFCapture(target, [1, 3]).capture(PROMPTS[:2])
    finally:
        for h in handles:
            h.remove()
    assert calls == []  # layers 4, 5, the final norm and the LM head never ran
    assert [list(layer._forward_hooks) for layer in target.model.layers] == before


class _FlakyEngine:
    """Raises CUDA OOM once for any batch of more than one sequence, then works."""

    name, layer_ids = "fake", [0]

    def __init__(self):
        self.batches: list[int] = []
        self.failed = False

    def capture(self, batch):
        if len(batch) > 1 and not self.failed:
            self.failed = True
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        self.batches.append(len(batch))
        return [torch.full((len(x), 1, 2), float(sum(x))) for x in batch]


def test_out_of_memory_retries_the_batch_at_half_size():
    seqs = [[i] * (i + 1) for i in range(8)]
    engine = _FlakyEngine()
    feats, size = capture_in_batches(engine, seqs, 8)
    assert size == 4 and engine.batches == [4, 4]
    assert [f[0, 0, 0].item() for f in feats] == [float(sum(s)) for s in seqs]  # input order kept


def test_out_of_memory_at_batch_one_is_raised():
    class Always:
        def capture(self, batch):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    with pytest.raises(torch.cuda.OutOfMemoryError):
        capture_in_batches(Always(), [[1, 2], [3]], 2)


def test_hf_capture_halves_on_oom_with_the_real_engine(target, monkeypatch):
    engine = HFCapture(target, [1, 3])
    want = engine.capture(PROMPTS)
    real, seen = engine.body.forward, []

    def forward(*args, **kwargs):
        seen.append(kwargs["input_ids"].shape[0])
        if kwargs["input_ids"].shape[0] > 1 and len(seen) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.body, "forward", forward)
    got, size = capture_in_batches(engine, PROMPTS, 4)
    assert seen == [4, 2, 2] and size == 2
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


# -- vLLM's hidden-states file protocol (the real engine is tested in tests/vllm/) -------------------


def _write_hidden(path, n=5):
    from safetensors.torch import save_file

    save_file({"hidden_states": torch.arange(n * 6, dtype=torch.float32).reshape(n, 2, 3),
               "token_ids": torch.arange(n)}, str(path))


def test_read_waits_for_the_writer_to_release_its_lock(tmp_path):
    """vLLM returns the path before the file exists; its writer holds LOCK_EX on `<path>.lock` until done."""
    import fcntl
    import os
    import threading

    from draftflow.engines.capture import read_hidden_states

    path = tmp_path / "req-1.safetensors"
    fd = os.open(str(path) + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    reading = threading.Event()
    result = {}

    def reader():
        reading.set()
        result["hidden"] = read_hidden_states(str(path), timeout_s=120)

    t = threading.Thread(target=reader)
    t.start()
    reading.wait()
    assert t.is_alive() or "hidden" not in result  # cannot have read: the file does not exist yet
    _write_hidden(path)
    os.close(fd)  # the writer is done: releases the lock
    t.join(timeout=120)
    assert result["hidden"].shape == (5, 2, 3)
    assert not path.exists() and not os.path.exists(str(path) + ".lock")  # both consumed


def test_read_times_out_in_one_line_naming_the_file(tmp_path):
    import fcntl
    import os

    from draftflow.engines.capture import CaptureTimeout, read_hidden_states

    path = tmp_path / "req-2.safetensors"
    fd = os.open(str(path) + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(CaptureTimeout, match="capture_timeout_s") as err:
            read_hidden_states(str(path), timeout_s=0.2)
    finally:
        os.close(fd)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_read_of_a_finished_write_returns_at_once(tmp_path):
    from draftflow.engines.capture import read_hidden_states

    path = tmp_path / "req-3.safetensors"
    _write_hidden(path, n=3)
    (tmp_path / "req-3.safetensors.lock").write_text("")
    assert read_hidden_states(str(path), timeout_s=5).shape == (3, 2, 3)
