"""The job file: typed dataclasses, parsing, `--set` overrides and validation (docs/job-file.md).

Every mistake raises `BadInput` naming the file, the key and what was expected. Relative paths in a job file
are resolved against the current working directory, like any command-line tool's arguments. The `engine:` and
`sampling:` sections are the engine's own `EngineConfig` and `SamplingParams`, built here without a copy.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import yaml

from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.pooling.pooler import TASKS, PoolerConfig

from .checks import (
    FieldError,
    TypeMismatch,
    at_least,
    check_fields,
    coerce,
    field_error,
    one_of,
    parse_size,
)
from .errors import BadInput
from .storage import is_url, location

STATE_DIR = ".batchrun"

__all__ = ["JobSpec", "ModelSpec", "load_job", "parse_job", "parse_size", "apply_overrides", "to_dict"]


def _adapter_names(v: dict) -> str | None:
    bad = [k for k, path in v.items() if not isinstance(k, str) or not k.strip() or not isinstance(path, str)]
    return f"a mapping of adapter names to folders, URLs or hub ids (not {bad[0]!r})" if bad else None


# the reserved name of the base model in an adapter column's cell or an OpenAI request's `model`: the base model
# even where `model.adapter` gives the job's rows an adapter
BASE_MODEL = "base"
# what an OpenAI reply names the embedded default model (no `model.path`, no `model.name`)
DEFAULT_MODEL_NAME = "batchrun-default-model"


@dataclass
class ModelSpec:
    path: str | None = None
    # the base model's name in an OpenAI request's `model` and in the replies (default: model.path as given)
    name: str | None = None
    dtype: str = field(default="auto", metadata={"check": one_of("auto", "float32", "bfloat16", "float16")})
    chat_template: bool = True
    system_prompt: str | None = None
    max_model_len: int | None = field(default=None, metadata={"check": at_least(1)})
    # LoRA adapters over the model (adapters.py, engine/model/lora/layers.py): {name: a PEFT adapter folder, URL or hub id}
    adapters: dict[str, str] = field(default_factory=dict, metadata={"check": _adapter_names})
    # the adapter of every row that names none (input.adapter_column's null cells too); None: the base model
    adapter: str | None = None
    # a rerun's answer to finished rows whose weights changed since they were written (the model's weight files,
    # or their adapter's: weights.py): recompute them | refuse (exit 2 naming what changed) | keep them as they are
    on_change: str = field(default="recompute", metadata={"check": one_of("recompute", "refuse", "keep")})

    def __post_init__(self) -> None:
        check_fields(self)
        if BASE_MODEL in self.adapters:
            raise FieldError(
                "adapters", f"{BASE_MODEL!r} names the base model; give the adapter another name"
            )
        if self.adapter is not None and self.adapter not in self.adapters:
            raise FieldError(
                "adapter",
                f"{self.adapter!r} is not one of model.adapters ({', '.join(self.adapters) or 'none'})",
            )

    @property
    def served_name(self) -> str:
        """The base model's name in OpenAI replies: model.name, else model.path as the job gives it."""
        return self.name or self.path or DEFAULT_MODEL_NAME

    def base_names(self) -> list[str]:
        """The names a request may give the base model: `base`, model.name, and model.path as given or its last
        part (an OpenAI request's `model: Llama-3.2-1B` for `model.path: /models/Llama-3.2-1B`)."""
        names = [BASE_MODEL, self.served_name]
        if self.path:
            names += [self.path, Path(self.path.rstrip("/")).name]
        return list(dict.fromkeys(names))

    def adapter_named(self, name: Any, where: str) -> str | None:
        """The adapter a row asks for by `name` (an adapter column's cell, an OpenAI request's `model`), None
        for the base model: no name takes model.adapter; an adapter's name that adapter; the base model's names
        (base_names) the base model. ValueError starting with `where` for any other name, naming the known ones:
        a request is never answered by other weights than it names."""
        if name is None:
            return self.adapter
        if isinstance(name, str) and name in self.adapters:
            return name
        if isinstance(name, str) and name in self.base_names():
            return None
        known = ", ".join([*self.adapters, *self.base_names()])
        raise ValueError(
            f"{where}: {name!r} is neither one of model.adapters nor the base model (known: {known})"
        )

    def name_of(self, adapter: str | None) -> str:
        """What ran, as a reply names it: the adapter's name, or the base model's."""
        return adapter if adapter is not None else self.served_name


# the sampling keys a row may set for itself (input.sampling_columns, or an OpenAI batch request's body)
ROW_SAMPLING_KEYS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "logprobs",
    "response_format",
    "ignore_eos",
)


def _row_sampling_keys(v: dict) -> str | None:
    bad = [k for k in v if k not in ROW_SAMPLING_KEYS]
    return (
        f"a mapping whose keys are among {', '.join(ROW_SAMPLING_KEYS)} (not {', '.join(bad)})"
        if bad
        else None
    )


@dataclass
class DatasetSpec:
    path: str = ""
    name: str | None = None
    split: str = "train"
    data_dir: str | None = None


@dataclass
class InputSpec:
    parquet: str | None = None
    dataset: DatasetSpec | None = None
    openai_batch: str | None = None  # an OpenAI Batch API input file (JSONL), or a glob of them
    # strings, conversations (lists of {role, content}), or token ids (lists of integers: no chat template)
    prompt_column: str = "prompt"
    # task: score (and classify of pairs): the column of each pair's second text (a passage or document), beside
    # the prompt column's first (a query); the two are tokenized together, as the model's tokenizer makes a pair
    pair_column: str | None = None
    # a column of images (an HF Image feature, bytes, or paths and URLs) put before the row's text prompt, for a
    # vision-language model
    image_column: str | None = None
    # task generate: the column naming each row's LoRA adapter (one of model.adapters; null: model.adapter, else
    # the base model)
    adapter_column: str | None = None
    id_column: str | None = None
    passthrough: list[str] = field(default_factory=list)
    limit: int | None = field(default=None, metadata={"check": at_least(0)})
    # per-row sampling: {sampling key: input column}; a null cell takes the job's value
    sampling_columns: dict[str, str] = field(default_factory=dict, metadata={"check": _row_sampling_keys})
    # a rerun's answer to a row whose input changed since its output was written: recompute it (and say how
    # many), or refuse the run (exit 2) and keep every part as it is
    on_change: str = field(default="recompute", metadata={"check": one_of("recompute", "refuse")})

    @property
    def base_dir(self) -> Path | None:
        """The folder an image path in a row is relative to: the local input file's (None for a dataset or a
        URL)."""
        source = self.parquet or self.openai_batch
        if not source or "://" in source:
            return None
        return Path(source).parent


@dataclass
class OutputSpec:
    path: str | None = None  # default: out/<name>/ -- completions only
    stats: str | None = None  # default: <path>/.batchrun/stats.parquet
    format: str = field(default="auto", metadata={"check": one_of("auto", "parquet", "jsonl")})
    token_ids: bool = False  # add prompt_token_ids and completion_token_ids columns
    # task: embed: the embedding column's element type (float16 halves its size; each component rounded to the
    # nearest float16, as torch's .half() rounds)
    embedding_dtype: str = field(default="float32", metadata={"check": one_of("float32", "float16")})
    rows_per_part: int = field(default=1000, metadata={"check": at_least(1)})  # a part file every N rows...
    flush_seconds: float = field(default=30.0, metadata={"check": at_least(0)})  # ...or every S seconds


@dataclass
class JobSpec:
    name: str = field(
        default="",
        metadata={
            "check": lambda v: (
                None
                if re.fullmatch(r"[\w.-]+", v)
                else "a non-empty name of letters, digits, '_', '-' or '.'"
            )
        },
    )
    model: ModelSpec = field(default_factory=ModelSpec)
    input: InputSpec = field(default_factory=InputSpec)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    engine: EngineConfig = field(default_factory=EngineConfig)
    output: OutputSpec = field(default_factory=OutputSpec)
    # what the job computes per row: generate (completions), or a pooling task (embed: a vector per text; classify:
    # a label; score: a pair's relevance; reward: a text's or conversation's reward)
    task: str = field(default="generate", metadata={"check": one_of(*TASKS)})
    pooler: PoolerConfig = field(
        default_factory=PoolerConfig
    )  # a pooling task's overrides (engine/pooling/pooler.py)
    source_file: str = field(default="<job>", metadata={"internal": True})

    @property
    def output_dir(self) -> Path:
        """`output.path`: a local folder, or a URL (storage.location: s3://bucket/prefix, gs://...)."""
        return location(self.output.path or f"out/{self.name}", "key `output.path`")

    @property
    def state_dir(self) -> Path:
        """Where everything but the completions lives: statistics, plots, Slurm scripts and logs. A folder whose
        name starts with '.' inside the output directory: pandas, pyarrow and datasets all skip it."""
        return self.output_dir / STATE_DIR

    @property
    def output_format(self) -> str:
        """parquet or jsonl (auto: jsonl for an OpenAI batch input, else parquet)."""
        if self.output.format != "auto":
            return self.output.format
        return "jsonl" if self.input.openai_batch else "parquet"

    def stats_source(self) -> Path:
        """Where every shard's statistics of this job are found (what `batchrun stats` takes): `output.stats`
        (with its shards' files beside it) or the state folder."""
        return location(self.output.stats, "key `output.stats`") if self.output.stats else self.state_dir

    def stats_path(self, shard_index: int = 0, shard_count: int = 1) -> Path:
        """`output.stats`, or by default `stats.parquet` in the state folder (`stats-IofN.parquet` for a shard
        of several, so shards writing into one directory never overwrite each other's statistics; an explicit
        `output.stats` likewise gets `NAME-IofN.parquet` beside it for a shard of several)."""
        if self.output.stats:
            given = location(self.output.stats, "key `output.stats`")
            if shard_count > 1:  # one file per shard beside the given name: `batchrun stats` combines them
                return given.with_name(f"{given.stem}-{shard_index:05d}of{shard_count:05d}{given.suffix}")
            return given
        if shard_count > 1:
            return self.state_dir / f"stats-{shard_index:05d}of{shard_count:05d}.parquet"
        return self.state_dir / "stats.parquet"


# --------------------------------------------------------------------------------------------------------------
# Parsing


def _coerce(value: Any, tp: Any, key: str, src: str) -> Any:
    """Check `value` against the annotation `tp` (checks.coerce); returns the value, dataclasses built. Raises
    BadInput naming the key."""
    try:
        return coerce(value, tp, key, lambda cls, raw, prefix: _build(cls, raw, prefix, src))
    except TypeMismatch as e:
        raise BadInput(f"{src}: key `{e.key}` must be {e.expected}, got {e.value!r}.") from None


def _build(cls: type, raw: Any, prefix: str, src: str) -> Any:
    where = f"`{prefix}`" if prefix else "the top level"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadInput(f"{src}: {where} must be a mapping of keys to values, got {raw!r}.")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    # keywords the dataclass takes as another field's other name (SamplingParams' max_tokens, vLLM's name for
    # max_new_tokens): keys too, type-checked here, folded in and value-checked by the dataclass
    aliases = {k: t.type for k, t in hints.items() if isinstance(t, dataclasses.InitVar)}
    for k in raw:
        if k not in fields and k not in aliases:
            known = ", ".join([*fields, *aliases])
            raise BadInput(
                f"{src}: unknown key `{prefix + '.' if prefix else ''}{k}` in {where}; "
                f"known keys there: {known}."
            )
    kwargs = {
        name: _coerce_field(f, hints[name], raw[name], f"{prefix}.{name}" if prefix else name, src)
        for name, f in fields.items()
        if name in raw
    }
    for name, tp in aliases.items():
        if name in raw:
            kwargs[name] = _coerce(raw[name], tp, f"{prefix}.{name}" if prefix else name, src)
    try:
        return cls(**kwargs)
    except FieldError as e:  # a check across fields, made by the dataclass itself
        key = f"{prefix}.{e.field}" if prefix else e.field
        raise BadInput(f"{src}: key `{key}`: {e.reason}.") from None


def set_key(raw: dict, path: str, value: Any) -> None:
    """raw["sampling"]["temperature"] = value for path `sampling.temperature`."""
    keys = path.strip().split(".")
    node = raw
    for k in keys[:-1]:
        if not isinstance(node.get(k), dict):
            node[k] = {}
        node = node[k]
    node[keys[-1]] = value


def coerce_field(cls: type, name: str, value: Any, key: str, src: str) -> Any:
    """One field of a config dataclass, type-checked and checked as the job file's parser does (BadInput)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return _coerce_field(f, typing.get_type_hints(cls)[name], value, key, src)


def _coerce_field(f: dataclasses.Field, tp: Any, value: Any, key: str, src: str) -> Any:
    coerced = _coerce(value, tp, key, src)
    expected = field_error(f, coerced)
    if expected:
        raise BadInput(f"{src}: key `{key}` must be {expected}, got {value!r}.")
    return coerced


def apply_override(raw: dict, assignment: str, src: str = "--set") -> None:
    """`sampling.temperature=0.7` -> raw["sampling"]["temperature"] = 0.7 (the value is parsed as YAML)."""
    if "=" not in assignment:
        raise BadInput(f"{src} {assignment!r}: expected KEY.PATH=VALUE, e.g. --set sampling.temperature=0.7.")
    path, text = assignment.split("=", 1)
    try:
        value = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError as e:  # never a silent string: `[a, b` is a list with a typo, not text
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise BadInput(
            f"{src} {assignment!r}: the value is not valid YAML ({problem}); quote it to pass a string, "
            f"e.g. {path}='\"{text}\"'."
        ) from None
    set_key(raw, path, value)


Overrides = Union[Mapping[str, Any], Sequence[str], None]  # noqa: UP007


def apply_overrides(raw: dict, overrides: Overrides) -> None:
    """`{"sampling.temperature": 0.7}` (values as they are) or `["sampling.temperature=0.7"]` (as YAML)."""
    if isinstance(overrides, Mapping):
        for path, value in overrides.items():
            set_key(raw, path, value)
    else:
        for assignment in overrides or ():
            apply_override(raw, assignment)


def parse_job(raw: Any, source: str = "<job>") -> JobSpec:
    """Build and validate a JobSpec from a parsed YAML mapping."""
    if not isinstance(raw, dict):
        raise BadInput(
            f"{source}: a job file must be a YAML mapping (name:, model:, input:, ...), "
            f"got {type(raw).__name__}."
        )
    spec = _build(JobSpec, raw, "", source)
    spec.source_file = source
    if not spec.name:
        raise BadInput(f"{source}: key `name` is missing; expected a short job name such as `demo`.")
    inp = spec.input
    kinds = [k for k in ("parquet", "dataset", "openai_batch") if getattr(inp, k) is not None]
    if len(kinds) != 1:
        raise BadInput(
            f"{source}: key `input` must have exactly one of `input.parquet` (a file, directory or "
            f"glob), `input.dataset` (path, name, split, data_dir) or `input.openai_batch` (a JSONL file or "
            f"glob); {'both ' + ' and '.join(kinds) if kinds else 'neither'} given."
        )
    for key in ("parquet", "openai_batch"):
        if getattr(inp, key) is not None and not str(getattr(inp, key)).strip():
            raise BadInput(f"{source}: key `input.{key}` is empty; expected a file, a directory or a glob.")
    if inp.openai_batch is not None:
        for key in ("id_column", "passthrough", "sampling_columns", "adapter_column"):
            if getattr(inp, key):
                raise BadInput(
                    f"{source}: key `input.{key}` does not apply to `input.openai_batch` (a request's id is its "
                    f"custom_id, its sampling its body, its adapter the body's model)."
                )
    if inp.dataset is not None and not inp.dataset.path:
        raise BadInput(
            f"{source}: key `input.dataset.path` is missing; expected a save_to_disk directory, "
            f"a data-file builder name (parquet, json, csv) with data_dir, or a cached dataset id."
        )
    _check_task(spec, source)
    if spec.task != "generate" and raw.get("sampling"):  # given, not compared with the defaults: any key set
        raise BadInput(
            f"{source}: key `sampling.{next(iter(raw['sampling']))}` applies to task generate, and task is "
            f"{spec.task} (a pooling task samples no tokens)."
        )
    urls = {"input.parquet": inp.parquet, "input.openai_batch": inp.openai_batch}
    urls |= {"output.path": spec.output.path, "output.stats": spec.output.stats}
    for key, value in urls.items():
        if value and is_url(value):
            location(value, f"{source}: key `{key}`")  # a scheme no installed file system serves: said now
    return spec


def _check_task(spec: JobSpec, source: str) -> None:
    """Pooler keys on a generation job, a pair column where it does not belong (or missing for score), and what a
    pooling job does not take: exit 2 naming the key."""
    if spec.task == "score" and spec.input.pair_column is None:
        raise BadInput(
            f"{source}: key `input.pair_column`: task score needs it (the column of each pair's second text)."
        )
    if spec.task not in ("score", "classify") and spec.input.pair_column is not None:
        raise BadInput(
            f"{source}: key `input.pair_column` applies to tasks score and classify (pairs), and task is "
            f"{spec.task}."
        )
    if spec.task == "classify" and spec.input.pair_column is None and spec.pooler.prompt_name is not None:
        raise BadInput(  # a pair's prompt (a cross-encoder's): transformers puts none before a text it classifies
            f"{source}: key `pooler.prompt_name` applies to task classify of pairs (input.pair_column), put "
            "before each pair's first text as CrossEncoder.predict puts it; a text is classified as it is."
        )
    if spec.output.embedding_dtype != "float32" and spec.task != "embed":
        raise BadInput(
            f"{source}: key `output.embedding_dtype` applies to task embed (its embedding column), and task is "
            f"{spec.task}."
        )
    if spec.input.adapter_column is not None and not spec.model.adapters:
        raise BadInput(
            f"{source}: key `input.adapter_column` names each row's LoRA adapter, and model.adapters is empty."
        )
    if spec.task != "generate" and spec.model.adapters:
        raise BadInput(
            f"{source}: key `model.adapters`: LoRA adapters apply to task generate, and task is {spec.task}."
        )
    if spec.task == "generate":
        changed = [
            f.name for f in dataclasses.fields(PoolerConfig) if getattr(spec.pooler, f.name) is not None
        ]
        if changed:
            raise BadInput(
                f"{source}: key `pooler.{changed[0]}` applies to a pooling task (task: embed), and task is "
                "generate."
            )
        return
    if spec.model.system_prompt is not None:
        # a pooling row is scored as given: a text has no chat template to put a system turn in, and a reward
        # conversation is judged with the turns it has (give it a system turn of its own)
        raise BadInput(
            f"{source}: key `model.system_prompt` applies to task generate, and task is {spec.task} (a pooling "
            "task takes each row's text, or conversation, as it is; put a system turn in the conversation)."
        )
    inp = spec.input
    batch = spec.task == "embed" and inp.openai_batch  # /v1/embeddings requests, answered in OpenAI's shape
    for key, value in (
        ("input.openai_batch", None if batch else inp.openai_batch),
        ("input.image_column", inp.image_column),
        ("input.sampling_columns", inp.sampling_columns),
        ("output.format", spec.output.format if spec.output.format == "jsonl" and not batch else None),
    ):
        if value:
            raise BadInput(
                f"{source}: key `{key}` does not apply to task {spec.task} (not built for it yet)."
            )


def load_job(path: str | Path, overrides: Overrides = ()) -> JobSpec:
    """Read a job YAML file, apply `--set` overrides, validate. Raises BadInput naming the file."""
    path = Path(path)
    src = str(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise BadInput(f"{src}: job file not found.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{src}: cannot read the job file ({e}).") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise BadInput(f"{src}: not valid YAML: {e}".replace("\n", " ")) from None
    if raw is None:
        raw = {}
    if isinstance(raw, dict):
        apply_overrides(raw, overrides)
    return parse_job(raw, src)


def to_dict(spec: JobSpec) -> dict:
    d = dataclasses.asdict(spec)
    d.pop("source_file", None)
    return d
