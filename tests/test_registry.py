"""The stage registry: one statement of the stages that plan, status, flows, runners and GPU slots share."""

from __future__ import annotations

import pytest

from draftflow.errors import ConfigError
from draftflow.stages.registry import needed, registry, spec, stage_gpus, stage_inputs, stage_names, upstream_of
from tests.conftest import tiny_config


def test_the_registry_is_in_dependency_order_with_known_upstreams():
    seen: set[str] = set()
    for s in registry():
        assert set(s.upstream) <= seen, f"{s.name} comes before its upstream {s.upstream}"
        assert isinstance(s.sections, tuple), s.name  # its fingerprint's config sections, on its spec
        seen.add(s.name)
    names = stage_names()
    assert names[0] == "curate" and needed(names[-1]) == list(names)  # the last stage needs every other one
    for s in registry():  # a stage needs itself last, after everything upstream of it (no more)
        want = {s.name, *s.upstream, *(u for up in s.upstream for u in needed(up))}
        assert needed(s.name)[-1] == s.name and set(needed(s.name)) == want
    assert upstream_of("evaluate") == ("curate", "train")


def test_an_unknown_stage_is_one_line():
    with pytest.raises(ConfigError, match="no stage 'filter'; the stages are curate, regenerate"):
        spec("filter")


def test_gpu_slots_follow_the_specs(tiny_cfg):
    assert [s.name for s in registry() if s.gpu] == ["regenerate", "extract", "train", "evaluate"]
    tiny_cfg.evaluate.engine = "vllm"
    tiny_cfg.regenerate.vllm.tensor_parallel_size = 4
    assert stage_gpus(tiny_cfg, "evaluate") == 4 and stage_gpus(tiny_cfg, "extract") == 1
    assert stage_gpus(tiny_cfg, "curate") == 1


def test_plan_and_the_curate_flow_compute_the_same_inputs_with_token_bounds(tmp_path, tiny_target):
    """The drift that made `plan` and `status` call a finished curate stage "to run": with token bounds and
    no `curate.tokenizer`, the stage counts with the target's tokenizer, whose fingerprint is an input."""
    from draftflow.runs.plan import plan
    from draftflow.stages import curate
    from draftflow.stages.registry import stamp
    from draftflow.store import Store

    cfg = tiny_config(tmp_path / "run", "curate.max_prompt_tokens=64")
    inputs = stage_inputs(cfg, "curate", None, {})
    assert inputs["tokenizer"] == tiny_target.fingerprint
    handed = stamp(cfg, "curate", inputs)
    fp = handed.fingerprint
    curate.run(Store(cfg.root), handed, cfg, curate.token_counter(cfg))  # as the curate flow does
    states = {s["stage"]: s for s in plan(cfg, tiny_target)}
    assert states["curate"]["fingerprint"] == fp and states["curate"]["state"] == "complete"
    assert states["regenerate"]["state"] == "to run"


def test_the_summary_names_each_stage_s_unit_and_keeps_the_export_order():
    """Row counts mean conversations, then sequences, then prompts: the run summary says which. Exports come
    in `train.EXPORT_FORMATS` order whether the train manifest was just written or read back (keys sorted)."""
    from flows.pipeline import _in_export_order

    assert [spec(n).unit for n in ("curate", "tokenize", "evaluate")] == ["conversations", "sequences", "prompts"]
    assert all(s.unit for s in registry())
    assert [f for f, _ in _in_export_order({"speculators": "b", "vllm": "a", "other": "c"})] == [
        "vllm", "speculators", "other"]


def test_the_registry_is_a_value_handed_to_a_run_and_never_changed(tmp_path):
    """`with_stage` makes another registry; `using` hands it to what runs inside (plan, status, flows, stamps)
    and the one in use is `REGISTRY` again after; nothing is written into a module."""
    from draftflow.stages.registry import REGISTRY, StageSpec, stamp, using

    extra = StageSpec("filter", about="a filter", sections=("tokenize",))
    other = REGISTRY.with_stage(extra, before="tokenize")
    was = REGISTRY.spec("tokenize").upstream  # ("regenerate",), or a stage a copy of the repository put in between
    names = other.names()
    assert "filter" not in REGISTRY.names() and names[names.index("filter") + 1] == "tokenize"
    assert other.spec("tokenize").upstream == ("filter",) and REGISTRY.spec("tokenize").upstream == was
    cfg = tiny_config(tmp_path / "run")
    with using(other):
        assert stage_names() == other.names() and upstream_of("filter") == was
        assert stamp(cfg, "filter", {}).config == {"tokenize": cfg.section("tokenize")}  # its spec's sections
    assert stage_names() == REGISTRY.names()
    with pytest.raises(ConfigError, match="no stage 'filter'"):
        stamp(cfg, "filter", {})
    with pytest.raises(ConfigError, match=r"stage 'loose': give its StageSpec sections=\(...\)"):
        StageSpec("loose")
