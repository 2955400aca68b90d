"""The stages of a run, stated once: one `StageSpec` per stage, in pipeline order.

Whatever walks the stages derives from `REGISTRY`: `plan` and `status` (order,
upstream, fingerprint inputs), the pipeline flow and the per-stage deployments (which
flows run, in order, and what each needs), the runners and the GPU slots (which stages
use a GPU and how many). A stage's fingerprint inputs are computed by `stage_inputs`
here for both the stage flows and `plan`, so the two cannot drift apart (they did:
curate's tokenizer input was missing from `plan`, which then called a finished curate
stage "to run").

What it does not know: Prefect, and the stage's work itself (the stage modules do it;
the flows map a task per shard). Trade-off: this module imports the stage modules it
describes, so no stage module may import it (a stage's code hash covers the modules it
imports, and one stage's edit must not recompute the others).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from draftflow.config import STAGE_SECTIONS, RunConfig
from draftflow.errors import ConfigError


def _no_gpus(cfg: RunConfig) -> int:
    return 0


def _vllm_group(engine: Callable[[RunConfig], str]) -> Callable[[RunConfig], int]:
    """GPUs of one unit of a stage that uses a GPU: a vLLM tensor-parallel group, else one."""
    def gpus(cfg: RunConfig) -> int:
        return cfg.regenerate.vllm.tensor_parallel_size if engine(cfg) == "vllm" else 1
    return gpus


@dataclass(frozen=True)
class StageSpec:
    """What the rest of draftflow needs to know about a stage.

    Attributes:
        name: the stage's folder under the run root and its flow's name.
        upstream: the stages whose manifests it reads, in the order its flow receives them.
        sections: config sections (or dotted fields) in its fingerprint (`config.STAGE_SECTIONS`).
        gpu: "shards" (each shard task holds GPU slots), "stage" (the whole stage holds them) or None.
        gpus: GPUs one unit of work occupies under a config (0 for CPU stages).
        split: which upstream shards the stage maps over ("train"; None: all).
        uses_target: whether the target's fingerprint is one of its inputs.
    """

    name: str
    upstream: tuple[str, ...]
    gpu: str | None = None
    gpus: Callable[[RunConfig], int] = _no_gpus
    split: str | None = None
    uses_target: bool = True
    sections: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sections", STAGE_SECTIONS[self.name])


REGISTRY: tuple[StageSpec, ...] = (
    StageSpec("curate", (), uses_target=False),
    StageSpec("regenerate", ("curate",), gpu="shards", gpus=_vllm_group(lambda c: c.regenerate.engine),
              split="train"),
    StageSpec("tokenize", ("regenerate",)),
    StageSpec("extract", ("tokenize",), gpu="shards", gpus=_vllm_group(lambda c: c.extract.engine), split="train"),
    StageSpec("train", ("extract",), gpu="stage", gpus=lambda c: c.train.nproc_per_node),
    StageSpec("evaluate", ("curate", "train"), gpu="stage", gpus=_vllm_group(lambda c: c.evaluate.engine)),
)
SPECS: dict[str, StageSpec] = {s.name: s for s in REGISTRY}
STAGES: tuple[str, ...] = tuple(s.name for s in REGISTRY)
UPSTREAM: dict[str, tuple[str, ...]] = {s.name: s.upstream for s in REGISTRY}


def spec(stage: str) -> StageSpec:
    """The spec of `stage`; an unknown name is a one-line error listing the known ones."""
    if stage not in SPECS:
        raise ConfigError(f"no stage {stage!r}; the stages are {', '.join(STAGES)}")
    return SPECS[stage]


def needed(stage: str) -> list[str]:
    """`stage` and every stage it depends on, in pipeline order."""
    want, todo = set(), [stage]
    while todo:
        s = todo.pop()
        want.add(s)
        todo += UPSTREAM[spec(s).name]
    return [s for s in STAGES if s in want]


def stage_gpus(cfg: RunConfig, stage: str) -> int:
    """GPUs one unit of `stage` occupies (at least 1 for a stage that uses the GPU at all)."""
    s = spec(stage)
    return max(1, s.gpus(cfg)) if s.gpu else 1


def external_inputs(cfg: RunConfig, stage: str) -> dict[str, str]:
    """Fingerprint inputs that come from outside the run: the sources' content keys for curate
    (and the target tokenizer's fingerprint when token bounds count with it)."""
    if spec(stage).upstream:
        return {}
    from draftflow.stages.curate import source_fingerprint_inputs

    return source_fingerprint_inputs(cfg)


def stage_inputs(cfg: RunConfig, stage: str, target_fp: str | None, digests: dict[str, str]) -> dict[str, str]:
    """The fingerprint inputs of `stage`: outside inputs, the target, and each upstream manifest's digest.

    Args:
        digests: the manifest digest of (at least) every upstream stage.
    """
    s = spec(stage)
    inputs = external_inputs(cfg, stage)
    if s.uses_target:
        inputs["target"] = target_fp
    return inputs | {u: digests[u] for u in s.upstream}
