"""How many slots of the GPU concurrency limit a stage takes (the limit itself: tests/test_server.py)."""

from contextlib import nullcontext

from draftflow.stages.registry import stage_gpus
from flows.deploy import gpu_slot
from tests.conftest import tiny_config


def test_a_stage_takes_as_many_slots_as_it_uses_gpus(tmp_path):
    cfg = tiny_config(tmp_path, "train.nproc_per_node=8", "regenerate.engine=vllm",
                      "regenerate.vllm.tensor_parallel_size=2")
    assert stage_gpus(cfg, "train") == 8  # one torchrun process per GPU
    assert stage_gpus(cfg, "regenerate") == 2  # a tensor-parallel group
    assert stage_gpus(cfg, "extract") == 1  # hf capture: one GPU per shard task
    assert stage_gpus(cfg, "evaluate") == 1


def test_no_slot_is_taken_without_a_limit_or_for_cpu_tasks(monkeypatch):
    monkeypatch.delenv("DRAFTFLOW_GPU_LIMIT", raising=False)
    assert isinstance(gpu_slot(gpus=8), nullcontext)  # make demo, tests, a laptop: no setup needed
    monkeypatch.setenv("DRAFTFLOW_GPU_LIMIT", "gpu")

    class CpuTask:
        tags = {"cpu"}

    assert isinstance(gpu_slot(CpuTask()), nullcontext)
    assert not isinstance(gpu_slot(gpus=8), nullcontext)
