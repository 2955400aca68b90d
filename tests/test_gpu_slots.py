"""How many slots of the GPU concurrency limit a stage takes (the limit itself: tests/test_server.py)."""

from contextlib import nullcontext

from draftflow.stages.registry import device_tags, on_gpu, stage_gpus, stage_names
from flows.deploy import gpu_slot
from tests.conftest import tiny_config


def test_a_stage_takes_as_many_slots_as_it_uses_gpus(tmp_path):
    cfg = tiny_config(tmp_path, "train.nproc_per_node=8", "regenerate.engine=vllm",
                      "regenerate.vllm.tensor_parallel_size=2")
    assert stage_gpus(cfg, "train") == 8  # one torchrun process per GPU
    assert stage_gpus(cfg, "regenerate") == 2  # a tensor-parallel group
    assert stage_gpus(cfg, "extract") == 1  # hf capture: one GPU per shard task
    assert stage_gpus(cfg, "evaluate") == 1


def test_no_slot_is_taken_without_a_limit(monkeypatch):
    monkeypatch.delenv("DRAFTFLOW_GPU_LIMIT", raising=False)
    assert isinstance(gpu_slot(gpus=8), nullcontext)  # make demo, tests, a laptop: no setup needed
    monkeypatch.setenv("DRAFTFLOW_GPU_LIMIT", "gpu")
    assert not isinstance(gpu_slot(gpus=8), nullcontext)


def test_task_runs_are_tagged_by_the_device_their_stage_runs_on(tmp_path):
    import torch

    assert not torch.cuda.is_available()  # this file's premise: `auto` resolves to the CPU here
    cfg = tiny_config(tmp_path)
    assert {s: device_tags(cfg, s) for s in stage_names()} == dict.fromkeys(stage_names(), {"cpu"})
    cfg = tiny_config(tmp_path, "train.device=cuda", "evaluate.device=cuda:1", "target.device=cuda")
    assert [s for s in stage_names() if on_gpu(cfg, s)] == ["regenerate", "extract", "train", "evaluate"]
    # An endpoint regenerates elsewhere, whatever the target's device
    assert not on_gpu(tiny_config(tmp_path, "target.device=cuda", "regenerate.engine=openai"), "regenerate")
    # On Ray, `auto` asks the cluster for runner.gpus_per_task GPUs; 0 makes the task a CPU one
    ray = ["runner.kind=ray", "runner.stages=[regenerate,extract]"]
    assert on_gpu(tiny_config(tmp_path, *ray), "regenerate") and on_gpu(tiny_config(tmp_path, *ray), "extract")
    assert not on_gpu(tiny_config(tmp_path, *ray, "runner.gpus_per_task=0"), "regenerate")
    assert not on_gpu(tiny_config(tmp_path, *ray, "target.device=cpu"), "extract")
    assert not on_gpu(tiny_config(tmp_path, *ray), "train")  # not placed on Ray: decided here
