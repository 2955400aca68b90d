"""The stages of a run, stated once: one `StageSpec` per stage, in pipeline order, in a `Registry`.

`REGISTRY` is built once, here, and never changed; a run with another set of stages (a test's, or a
user's stage put in with `REGISTRY.with_stage(spec, before=...)`, a new value) is handed it by running
the pipeline flow, `plan` or `status` inside `using(stages)`, which makes it the registry of that block's
context (a context variable: Prefect's task threads inherit it; another process, a Ray worker or a
deployment's, reads `REGISTRY`). Whatever walks the stages derives from
the registry in use: `plan` and `status` (order,
upstream, fingerprint inputs), the pipeline flow and the per-stage deployments (which
flows run, in order, and what each needs), the runners and the GPU slots (which stages
use a GPU and how many). A stage's fingerprint inputs are computed by `stage_inputs`
here for both the stage flows and `plan`, so the two cannot drift apart (they did:
curate's tokenizer input was missing from `plan`, which then called a finished curate
stage "to run").

What it does not know: Prefect, and the stage's work itself (the stage modules do it;
the flows map a task per shard). Trade-off: this module imports the stage modules it
describes, so no stage module may import it (a stage's code hash covers the modules it
imports, and one stage's edit must not recompute the others). It imports them when a
stage's function is first called, not at import: they pull torch and transformers, and
`draftflow status` and a config error must answer without them.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from draftflow.codehash import library_versions
from draftflow.config import RunConfig
from draftflow.contracts import ShardResult, Stamp
from draftflow.errors import ConfigError
from draftflow.stages.common import stamp as stage_stamp


def _vllm_group(engine: Callable[[RunConfig], str]) -> Callable[[RunConfig], int]:
    """GPUs of one unit of a stage that uses a GPU: a vLLM tensor-parallel group, else one."""
    def gpus(cfg: RunConfig) -> int:
        return cfg.regenerate.vllm.tensor_parallel_size if engine(cfg) == "vllm" else 1
    return gpus


def _in_stage(stage: str, name: str) -> Callable[..., Any]:
    """`draftflow.stages.<stage>.<name>`, its module imported when first called (see the module docstring):
    one rule for every stage instead of a wrapper per function. A computed import is safe here alone, as no
    stage module imports this one, so no stage's code hash (`draftflow.codehash.closure`) depends on it."""
    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(f"draftflow.stages.{stage}"), name)(*args, **kwargs)

    call.__qualname__ = call.__name__ = f"{stage}.{name}"
    return call


def _estimate(name: str, model: str) -> Callable[..., Any]:
    """`draftflow.stages.estimate.<name>_<model>`, the size or time model of a stage (imported when `plan` first
    calls it)."""
    def estimated(*args: Any) -> Any:
        from draftflow.stages import estimate

        return getattr(estimate, f"{name}_{model}")(*args)
    return estimated


def _size(name: str) -> Callable[..., dict[str, Any]]:
    return _estimate(name, "size")


def _seconds(name: str) -> Callable[..., float | None]:
    return _estimate(name, "seconds")


def _compare_with_inputs(cfg: RunConfig) -> dict[str, str]:
    """Evaluate: the content of the drafters `evaluate.compare_with` names (a changed one re-runs evaluate)."""
    if not cfg.evaluate.compare_with:
        return {}
    from draftflow.evaluation.compare_with import fingerprint_input

    return {"compare_with": fingerprint_input(cfg.root, cfg.evaluate.compare_with)}


def _train_inputs(cfg: RunConfig) -> dict[str, str]:
    """Train: the content of the drafter `train.init_from` warm-starts from (a newly promoted one re-runs train)."""
    if not cfg.train.init_from:
        return {}
    from draftflow.training.warm import fingerprint_input

    return fingerprint_input(cfg.root, cfg.train.init_from)


def _tokenize_inputs(cfg: RunConfig) -> dict[str, str]:
    """Tokenize: the fewest supervised tokens a sequence keeps (`tokenize.min_supervised_tokens`, else the drafter
    kind's rule), as a value: kinds that need the same share one tokenize stage."""
    from draftflow.drafters.taps import min_supervised_tokens

    return {"min_supervised_tokens": str(min_supervised_tokens(cfg.drafter, cfg.tokenize.min_supervised_tokens))}


def _extract_inputs(cfg: RunConfig) -> dict[str, str]:
    """Extract: whether the target's final state is stored for soft labels (`drafter.distill_top_k`)."""
    from draftflow.drafters.taps import final_state_input

    return final_state_input(cfg.drafter)


# Third-party libraries whose version can change a stage's bytes (in its code hash, `draftflow.codehash`):
# the chat template renderer and tokenizer, the model code and kernels.
TARGET_LIBRARIES = ("torch", "transformers")


@dataclass(frozen=True)
class StageSpec:
    """What the rest of draftflow needs to know about a stage.

    Attributes:
        name: the stage's folder under the run root and its flow's name.
        upstream: the stages whose manifests it reads, in the order its flow receives them; None: the stage
            before it in the registry (so a stage put before regenerate, tokenize or extract needs no edit to
            them: they read what they are handed; train still finds tokenize's token counts by that name).
        about: what it does, in one line (its deployment's description).
        sections: config sections (or dotted fields) in its fingerprint, recorded in its manifest (`stamp`);
            required (`()` for none: its code and inputs are then its fingerprint).
        gpu: "shards" (each shard task holds GPU slots), "stage" (the whole stage holds them) or None.
        gpus: GPUs one unit of work occupies under a config (0 for CPU stages).
        device: `cfg -> the device setting its work runs on` ("auto", "cpu", "cuda:1", "remote" for an
            endpoint) for a `gpu` stage; its task runs are tagged `gpu` or `cpu` from it (`device_tags`).
        split: which upstream shards the stage maps over ("train"; None: all).
        uses_target: whether the target's fingerprint is one of its inputs.
        run_shard: `(store, fp, cfg, target, source, shard) -> shard result` for a stage with one
            task per input shard (the generic sharded stage flow maps it); None: the stage has a flow
            of its own.
        check: `(cfg, target)`, run before any shard (e.g. an unreachable endpoint fails here).
        finish: `(store, fp, cfg, target, results) -> (results, manifest extra)`, after every shard.
        libraries: third-party packages whose versions are part of its code hash (`draftflow.codehash`).
        size: `(cfg, upstream size, sizes so far, ctx) -> size` for `plan`; None: at most its input.
        seconds: `(cfg, size, model shape, prompt tokens) -> seconds or None` for `plan`; None: unknown.
        more_inputs: `cfg -> fingerprint inputs` read outside the run's stages (evaluate: `compare_with`).
        unit: what one of its output rows is, as the run summary names it.
        makes: what its folder holds for code outside the stages, which finds the folder by it (`maker`):
            "conversations", "sequences", "token_counts", "features", "drafter", "evaluation".
        resumes: `cfg -> how an unfinished run of it resumes`, for `status`: "shards" (output shards committed,
            in-shard checkpoints), "steps" (training checkpoints) or None (it starts over); None: "shards" for a
            stage with a `run_shard`.
        output_suffix: its output shard's name is its input shard's with this suffix for ".parquet" (None: the
            same name), for `status` to count the shards done.
    """

    name: str
    upstream: tuple[str, ...] | None = None
    about: str = ""
    gpu: str | None = None
    gpus: Callable[[RunConfig], int] = lambda cfg: 0
    device: Callable[[RunConfig], str] | None = None
    split: str | None = None
    uses_target: bool = True
    sections: tuple[str, ...] | None = None
    run_shard: Callable[..., dict[str, Any]] | None = None
    check: Callable[..., None] | None = None
    finish: Callable[..., tuple[list[ShardResult], dict[str, Any]]] | None = None
    libraries: tuple[str, ...] = ()
    size: Callable[..., dict[str, Any]] | None = None
    seconds: Callable[..., float | None] | None = None
    more_inputs: Callable[[RunConfig], dict[str, str]] | None = None
    unit: str = "rows"
    makes: tuple[str, ...] = ()
    resumes: Callable[[RunConfig], str | None] | None = None
    output_suffix: str | None = None

    def __post_init__(self) -> None:
        if self.sections is None:
            raise ConfigError(f"stage {self.name!r}: give its StageSpec sections=(...), the config fields in its "
                              "fingerprint (() for none)")


@dataclass(frozen=True)
class Registry:
    """The stages of a run, in pipeline order (each after its upstream): a value, never changed in place."""

    stages: tuple[StageSpec, ...]

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for s in self.stages:
            if s.name in seen or s.upstream is None or not set(s.upstream) <= seen:
                raise ConfigError(f"stage {s.name!r}: its name is taken, or it reads {s.upstream}, not stages before "
                                  "it; fix the StageSpec")
            seen.add(s.name)

    @classmethod
    def chained(cls, stages: list[StageSpec]) -> Registry:
        """`stages` with each unset `upstream` set to the stage before it."""
        return cls(tuple(dataclasses.replace(s, upstream=(stages[i - 1].name,) if i else ()) if s.upstream is None
                         else s for i, s in enumerate(stages)))

    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.stages)

    def spec(self, stage: str) -> StageSpec:
        """The spec of `stage`; an unknown name is a one-line error listing the known ones."""
        for s in self.stages:
            if s.name == stage:
                return s
        raise ConfigError(f"no stage {stage!r}; the stages are {', '.join(self.names())}")

    def with_stage(self, new: StageSpec, before: str) -> Registry:
        """Another registry: `new` between `before` and its upstream (`new` reads what `before` read, and `before`
        reads `new`'s output). This one is unchanged.

        Raises:
            ConfigError: `before` is unknown, has other than one upstream, or `new`'s name is taken.
        """
        old = self.spec(before)
        if new.name in self.names() or len(old.upstream) != 1:
            raise ConfigError(f"cannot put stage {new.name!r} before {before!r}: the name is taken or "
                              f"{before} does not read exactly one stage")
        at = self.stages.index(old)
        put = (dataclasses.replace(new, upstream=old.upstream), dataclasses.replace(old, upstream=(new.name,)))
        return Registry(self.stages[:at] + put + self.stages[at + 1:])


# The stages, in pipeline order: one entry each.
REGISTRY = Registry.chained([
    StageSpec("curate", (), "Curate the sources (CPU).", sections=("curate",), uses_target=False, size=_size("curate"),
              seconds=_seconds("curate"), unit="conversations", makes=("conversations",)),
    StageSpec("regenerate", about="Regenerate the answers with the target.", sections=("target", "regenerate"),
              gpu="shards",
              gpus=_vllm_group(lambda c: c.regenerate.engine), split="train",
              device=lambda c: "remote" if c.regenerate.engine == "openai" else c.target.device,
              run_shard=_in_stage("regenerate", "run_shard"), check=_in_stage("regenerate", "check_engine"),
              libraries=(*TARGET_LIBRARIES, "tokenizers"), size=_size("regenerate"), seconds=_seconds("regenerate"),
              unit="conversations"),
    StageSpec("tokenize", about="Tokenize with assistant-only loss masks (CPU).",
              sections=("target", "tokenize"),  # + the kind's minimum supervised tokens (`_tokenize_inputs`)
              run_shard=_in_stage("tokenize", "run_shard"),
              finish=_in_stage("tokenize", "finish_stage"),
              libraries=("transformers", "tokenizers"), size=_size("tokenize"), seconds=_seconds("tokenize"),
              more_inputs=_tokenize_inputs, unit="sequences", makes=("sequences", "token_counts")),
    StageSpec("extract", about="Capture the target's hidden states at the taps.",
              # the taps and the kind (its default taps, whether the final state is stored), not the drafter's depth
              sections=("target", "extract", "drafter.kind", "drafter.target_layer_ids", "drafter.num_taps"),
              gpu="shards",
              gpus=_vllm_group(lambda c: c.extract.engine), device=lambda c: c.target.device, split="train",
              run_shard=_in_stage("extract", "run_shard"),
              libraries=TARGET_LIBRARIES, size=_size("extract"), seconds=_seconds("extract"),
              more_inputs=_extract_inputs, unit="sequences", makes=("features",), output_suffix=".safetensors",
              resumes=lambda c: None if c.extract.mode == "online" else "shards"),
    StageSpec("train", about="Train the drafter.", sections=("target", "drafter", "train"), gpu="stage",
              gpus=lambda c: c.train.nproc_per_node,
              device=lambda c: c.train.device,
              libraries=TARGET_LIBRARIES, size=_size("train"), seconds=_seconds("train"), more_inputs=_train_inputs,
              unit="sequences", makes=("drafter",), resumes=lambda c: "steps"),
    StageSpec("evaluate", ("curate", "train"), "Measure the drafter's acceptance length by speculative decoding.",
              sections=("target", "drafter", "evaluate", "regenerate.enable_thinking", "extract.dtype"),
              gpu="stage", gpus=_vllm_group(lambda c: c.evaluate.engine), device=lambda c: c.evaluate.device,
              libraries=TARGET_LIBRARIES, size=_size("evaluate"), seconds=_seconds("evaluate"),
              more_inputs=_compare_with_inputs, unit="prompts", makes=("evaluation",)),
])
_IN_USE: ContextVar[Registry] = ContextVar("draftflow_registry", default=REGISTRY)


@contextmanager
def using(stages: Registry | None) -> Iterator[Registry]:
    """Make `stages` the registry of this context for the block (None: leave the one in use)."""
    if stages is None:
        yield current()
        return
    token = _IN_USE.set(stages)
    try:
        yield stages
    finally:
        _IN_USE.reset(token)


def current() -> Registry:
    """The registry in use: `REGISTRY`, or what an entry point was handed (`using`)."""
    return _IN_USE.get()


def registry() -> tuple[StageSpec, ...]:
    """Every stage of the registry in use, in pipeline order (each after its upstream)."""
    return current().stages


def stage_names() -> tuple[str, ...]:
    return current().names()


def spec(stage: str) -> StageSpec:
    """The spec of `stage` in the registry in use; an unknown name is a one-line error listing the known ones."""
    return current().spec(stage)


def upstream_of(stage: str) -> tuple[str, ...]:
    return spec(stage).upstream


def downstream_of(stage: str) -> list[str]:
    """The stages that read `stage`'s manifest."""
    return [s.name for s in registry() if stage in s.upstream]


def needed(stage: str) -> list[str]:
    """`stage` and every stage it depends on, in pipeline order."""
    want, todo = set(), [stage]
    while todo:
        s = todo.pop()
        want.add(s)
        todo += upstream_of(s)
    return [s for s in stage_names() if s in want]


def stamp(cfg: RunConfig, stage: str, inputs: dict[str, str]) -> Stamp:
    """What `stage` is handed to run under `cfg` with these fingerprint inputs: its fingerprint and the config
    sections its spec names (`stages.common.stamp`)."""
    return stage_stamp(stage, spec(stage).sections, cfg, inputs)


def stage_gpus(cfg: RunConfig, stage: str) -> int:
    """GPUs one unit of `stage` occupies (at least 1 for a stage that uses the GPU at all)."""
    s = spec(stage)
    return max(1, s.gpus(cfg)) if s.gpu else 1


def resumes(cfg: RunConfig, stage: str) -> str | None:
    """How an unfinished run of `stage` resumes (`StageSpec.resumes`): "shards", "steps" or None."""
    s = spec(stage)
    if s.resumes is not None:
        return s.resumes(cfg)
    return "shards" if s.run_shard is not None else None


def maker(what: str) -> str:
    """The stage whose folder holds `what` (`StageSpec.makes`: "drafter" is train's): code outside the stages finds
    a stage's folder by what it holds, never by the stage's name.

    Raises:
        ConfigError: no stage makes it (a registry without that stage).
    """
    found = [s.name for s in registry() if what in s.makes]
    if len(found) != 1:
        raise ConfigError(f"no one stage of the registry makes {what!r} (found {found}); give one StageSpec "
                          f"makes=({what!r},)")
    return found[0]


def on_gpu(cfg: RunConfig, stage: str) -> bool:
    """Whether `stage`'s work runs on a GPU in this run, from its device setting. `auto` is decided where the
    run starts (CUDA visible or not), except for a stage placed on Ray, where `runner.gpus_per_task` asks the
    cluster for GPUs."""
    s = spec(stage)
    device = s.device(cfg) if s.gpu and s.device else "cpu"
    if device != "auto":
        return device.startswith("cuda")
    if cfg.runner.kind == "ray" and stage in cfg.runner.stages:
        return cfg.runner.gpus_per_task > 0
    import torch

    return torch.cuda.is_available()


def device_tags(cfg: RunConfig, stage: str) -> set[str]:
    """The tag of `stage`'s task runs in this run: `gpu` where its work uses one (`on_gpu`), else `cpu`. Ray
    asks for `runner.gpus_per_task` GPUs for a `gpu` task; the UI shows which runs held a GPU."""
    return {"gpu"} if on_gpu(cfg, stage) else {"cpu"}


def external_inputs(cfg: RunConfig, stage: str) -> dict[str, str]:
    """Fingerprint inputs that come from outside the run: the sources' content keys for curate
    (and the target tokenizer's fingerprint when token bounds count with it)."""
    if spec(stage).upstream:
        return {}
    from draftflow.stages.curate import source_fingerprint_inputs

    return source_fingerprint_inputs(cfg)


def stage_inputs(cfg: RunConfig, stage: str, target_fp: str | None, digests: dict[str, str]) -> dict[str, str]:
    """The fingerprint inputs of `stage`: outside inputs, the target, the versions of the libraries that
    shape its bytes, and each upstream manifest's digest.

    Args:
        digests: the manifest digest of (at least) every upstream stage.
    """
    s = spec(stage)
    inputs = external_inputs(cfg, stage)
    if s.uses_target:
        inputs["target"] = target_fp
    if s.libraries:  # their versions: a new transformers may render or compute differently
        inputs["libraries"] = library_versions(s.libraries)
    if s.more_inputs:
        inputs |= s.more_inputs(cfg)
    return inputs | {u: digests[u] for u in s.upstream}
