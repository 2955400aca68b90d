"""The `curate` config section and its sources: what curation reads, keeps and holds out.

Here rather than in `draftflow.config` because the section belongs to curation (and that module is at
its size limit); `draftflow.config.RunConfig` holds it like every other section.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PrivateAttr, model_validator

from draftflow.config.fields import Regex, Section


class SelfInstructConfig(Section):
    """A source whose user prompts the target writes (`draftflow.data.self_instruct`): completions of its chat
    template cut at the user turn's header, cleaned, deduplicated, cached as a prompt-format JSONL file."""

    count: int = Field(ge=1, description="prompts to write")
    max_new_tokens: int = Field(96, ge=1, description="a completion cut at this many tokens is dropped")
    temperature: float = Field(1.0, gt=0.0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    seed: int = 0
    system: str | None = Field(None, description="system prompt rendered before the user header; null = none "
                               "(the template's default system prompt, if it has one)")
    max_chars: int = Field(2000, ge=1, description="prompts longer than this are cut to it")


class CodeStubsConfig(Section):
    """A source of "complete this function" prompts (`draftflow.data.code_stubs`): the signature and docstring of
    each public top-level function in installed Python code, asked as HumanEval asks; the target writes the body."""

    count: int = Field(ge=1, description="prompts to write (fewer when the packages hold fewer functions)")
    packages: list[str] = Field(default_factory=lambda: ["stdlib"], min_length=1,
                                description="'stdlib' (Python's standard library) or installed packages' import names")
    seed: int = Field(0, description="which stubs: the first `count` by sha256(seed, stub)")
    min_doc_chars: int = Field(80, ge=1, description="functions with a shorter docstring are left out")
    max_chars: int = Field(1500, ge=1, description="stubs longer than this are left out, never cut")


class SourceConfig(Section):
    """One input dataset: files by path (local, s3://, globs, or inside an installed Python `package`), a
    Hugging Face dataset by name, prompts the target writes (`self_instruct`) or function stubs from installed
    Python code (`code_stubs`).

    `columns` maps the column an adapter reads to this source's column
    (`{question: input_text}` lets the openorca adapter read `input_text`).
    Mixture: `count` is a target number of kept rows; `weight` a share of
    `curate.total_rows` (or, without it, the largest mix the weights allow).
    """

    name: str = Field(min_length=1)
    path: str | None = Field(None, min_length=1, description="file/glob (local, s3://): .jsonl(.gz|.zst) or .parquet")
    hf: str | None = Field(None, description="Hugging Face dataset name, read with datasets' streaming loader")
    hf_config: str | None = None
    hf_split: str = "train"
    package: str | None = Field(None, min_length=1, description="installed Python package (import name); "
                                "`path` is then relative to its folder")
    pip: str | None = Field(None, min_length=1, description="what `pip install` takes to install `package`; "
                            "null = the package name with _ -> -")
    self_instruct: SelfInstructConfig | None = Field(None, description="the target writes this source's prompts")
    code_stubs: CodeStubsConfig | None = Field(None, description="function stubs from installed Python code")
    format: Literal["auto", "sharegpt", "openai", "alpaca", "openorca", "magicoder", "prompt",
                    "function_calling", "humaneval"] = "auto"
    columns: dict[str, str] = Field(default_factory=dict, description="adapter column -> source column")
    count: int | None = Field(None, ge=0, description="keep at most this many rows of this source")
    weight: float | None = Field(None, gt=0.0, description="share of the mixture (with the other weights)")
    category: str | None = Field(None, min_length=1, description="evaluation category of its rows (chat, code, math)")
    category_field: str | None = Field(None, min_length=1, description="row column naming the category (else category)")
    split: Literal["train", "eval"] | None = Field(None, description="every row to this split; null = eval_fraction")
    max_row_bytes: int = Field(16 << 20, ge=1024, description="a JSONL line longer than this is rejected "
                               "(row_too_large) without being held in memory whole")
    # self_instruct, code_stubs: the generated prompts file, set at stage start (`stages.curate.materialize_sources`);
    # in no fingerprint by itself (the file's key is, through curate's source keys).
    _generated: str | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _one_location(self) -> SourceConfig:
        if sum(x is not None for x in (self.path, self.hf, self.self_instruct, self.code_stubs)) != 1:
            raise ValueError(f"source '{self.name}' needs exactly one of path, hf, self_instruct or code_stubs")
        if self.count is not None and self.weight is not None:
            raise ValueError(f"source '{self.name}' sets both count and weight; keep one")
        self._check_package()
        if self.generator is not None and (self.format not in ("auto", "prompt") or self.columns):
            raise ValueError(f"source '{self.name}': {self.generator} writes prompt rows; remove format and columns")
        return self

    def _check_package(self) -> None:
        if self.package is None:
            if self.pip is not None:
                raise ValueError(f"source '{self.name}' sets pip without package")
            return
        if self.path is None or "://" in self.path or self.path.startswith(("/", "~")):
            raise ValueError(f"source '{self.name}' sets package: give path relative to the package's folder "
                             "(e.g. data/HumanEval.jsonl.gz)")

    @property
    def generator(self) -> str | None:
        """'self_instruct' or 'code_stubs' for a source whose prompts file draftflow writes, else None."""
        if self.self_instruct is not None:
            return "self_instruct"
        if self.code_stubs is not None:
            return "code_stubs"
        return None

    @property
    def generated(self) -> str | None:
        """self_instruct, code_stubs: the generated prompts file once materialized, else None."""
        return self._generated

    def use_generated(self, path: str) -> None:
        """Point a self_instruct or code_stubs source at its generated prompts file."""
        assert self.generator is not None, self.name
        self._generated = path


class CurateConfig(Section):
    """Curation: filters, dedup, mixture and split. Lengths count the prompt (system + user text)."""

    sources: list[SourceConfig] = Field(default_factory=list)
    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    shard_rows: int = Field(1000, ge=1)
    seed: int = 0
    min_prompt_chars: int = Field(1, ge=0)
    max_prompt_chars: int | None = Field(None, ge=1)
    min_prompt_tokens: int | None = Field(None, ge=0, description="counted with curate.tokenizer (or the target's)")
    max_prompt_tokens: int | None = Field(None, ge=1)
    tokenizer: str | None = Field(None, description="tokenizer for token bounds; null = the target's")
    blocklist: list[Regex] = Field(default_factory=list, description="regexes; a prompt matching any is dropped")
    max_non_latin: float | None = Field(
        None, ge=0.0, le=1.0, description="drop prompts whose letters are more than this share non-Latin")
    near_dup_threshold: float | None = Field(
        None, gt=0.0, le=1.0, description="MinHash LSH near-dup removal at this Jaccard; null = off (0.9 typical)")
    near_dup_ngram: int = Field(3, ge=1, description="word n-grams hashed for near-dup (and decontaminate)")
    decontaminate: float | None = Field(
        0.8, gt=0.0, le=1.0, description="drop train rows whose MinHash Jaccard to an eval row is at least this "
        "(exact copies of an eval prompt always go); null = off")
    total_rows: int | None = Field(None, ge=1, description="mixture size shared by weighted sources")

    @model_validator(mode="after")
    def _bounds_ordered(self) -> CurateConfig:
        for unit, lo, hi in (("chars", self.min_prompt_chars, self.max_prompt_chars),
                             ("tokens", self.min_prompt_tokens, self.max_prompt_tokens)):
            if lo is not None and hi is not None and lo > hi:
                raise ValueError(f"curate.min_prompt_{unit}={lo} is above curate.max_prompt_{unit}={hi}; "
                                 "no prompt can pass")
        return self
