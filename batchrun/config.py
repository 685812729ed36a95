"""The job file: typed dataclasses, parsing, `--set` overrides and validation (DESIGN.md, "Job file").

Every mistake raises `BadInput` naming the file, the key and what was expected. Relative paths in a job file
are resolved against the current working directory, like any command-line tool's arguments.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import yaml

from .errors import BadInput

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str | int) -> int:
    """'4GiB' -> 4294967296; an int is taken as bytes. Raises ValueError on anything else."""
    if isinstance(text, bool):
        raise ValueError(text)
    if isinstance(text, int):
        if text < 0:
            raise ValueError(text)
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(text)
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


def _one_of(*choices: str):
    def check(v: Any) -> str | None:
        return None if v in choices else f"one of {', '.join(choices)}"

    return check


def _at_least(lo: float, strict: bool = False):
    def check(v: Any) -> str | None:
        ok = v > lo if strict else v >= lo
        return None if ok else f"a number {'>' if strict else '>='} {lo}"

    return check


def _power_of_two(v: int) -> str | None:
    return None if v >= 1 and v & (v - 1) == 0 else "a power of two (8, 16, 32, ...)"


def _size_or_fraction(v: Any) -> str | None:
    if isinstance(v, float | int) and not isinstance(v, bool):
        return None if 0 < v <= 1 else 'a fraction in (0, 1] or a size such as "2GiB"'
    try:
        parse_size(v)
        return None
    except ValueError:
        return 'a fraction in (0, 1] or a size such as "2GiB"'


def _size(v: Any) -> str | None:
    try:
        parse_size(v)
        return None
    except ValueError:
        return 'a size such as "4GiB" or a number of bytes'


@dataclass
class ModelSpec:
    path: str | None = None
    dtype: str = field(default="auto", metadata={"check": _one_of("auto", "float32", "bfloat16", "float16")})
    chat_template: bool = True
    system_prompt: str | None = None
    max_model_len: int | None = field(default=None, metadata={"check": _at_least(1)})


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
    prompt_column: str = "prompt"
    id_column: str | None = None
    passthrough: list[str] = field(default_factory=list)
    limit: int | None = field(default=None, metadata={"check": _at_least(0)})


@dataclass
class SamplingSpec:
    max_new_tokens: int = field(default=256, metadata={"check": _at_least(1)})
    temperature: float = field(default=0.0, metadata={"check": _at_least(0)})
    top_p: float = field(
        default=1.0, metadata={"check": lambda v: None if 0 < v <= 1 else "a number in (0, 1]"}
    )
    top_k: int = field(default=-1, metadata={"check": lambda v: None if v == -1 or v >= 1 else "-1 or >= 1"})
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    n: int = field(default=1, metadata={"check": _at_least(1)})
    ignore_eos: bool = False


@dataclass
class EngineSpec:
    device: str = field(
        default="auto",
        metadata={
            "check": lambda v: (
                None
                if v in ("auto", "cpu", "cuda") or str(v).startswith("cuda:")
                else "auto, cpu, cuda or cuda:N"
            )
        },
    )
    attention: str = field(default="auto", metadata={"check": _one_of("auto", "triton", "torch")})
    page_size: int = field(default=16, metadata={"check": _power_of_two})
    kv_cache_memory: Union[float, str] = field(default=0.9, metadata={"check": _size_or_fraction})  # noqa: UP007
    num_pages: int | None = field(default=None, metadata={"check": _at_least(1)})
    swap_space: Union[str, int] = field(default="4GiB", metadata={"check": _size})  # noqa: UP007
    max_num_seqs: int = field(default=256, metadata={"check": _at_least(1)})
    max_num_batched_tokens: int = field(default=8192, metadata={"check": _at_least(1)})
    prefix_sharing: bool = True
    preemption: str = field(default="swap", metadata={"check": _one_of("swap", "recompute")})


@dataclass
class OutputSpec:
    path: str | None = None  # default: out/<name>/
    stats: str | None = None  # default: <path>/stats.parquet
    rows_per_part: int = field(default=1000, metadata={"check": _at_least(1)})  # a part file every N rows...
    flush_seconds: float = field(default=30.0, metadata={"check": _at_least(0)})  # ...or every S seconds


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
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
    output: OutputSpec = field(default_factory=OutputSpec)
    source_file: str = field(default="<job>", metadata={"internal": True})

    @property
    def output_dir(self) -> Path:
        return Path(self.output.path or f"out/{self.name}")

    @property
    def stats_path(self) -> Path:
        return Path(self.output.stats) if self.output.stats else self.output_dir / "stats.parquet"


# --------------------------------------------------------------------------------------------------------------
# Parsing


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}s"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, key: str, src: str) -> Any:
    """Check `value` against the annotation `tp`; returns the value (dataclasses built). Raises BadInput."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key, src)
            except BadInput:
                continue
        raise BadInput(f"{src}: key `{key}` must be {_type_name(tp)}, got {value!r}.")
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key, src)
    if origin is list:
        (elem,) = typing.get_args(tp)
        if isinstance(value, str) and elem is str:
            value = [value]  # a single stop string / passthrough column is accepted as a one-item list
        if not isinstance(value, list):
            raise BadInput(f"{src}: key `{key}` must be {_type_name(tp)}, got {value!r}.")
        return [_coerce(v, elem, f"{key}[{i}]", src) for i, v in enumerate(value)]
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }[tp](value)
    if not ok:
        raise BadInput(f"{src}: key `{key}` must be {_type_name(tp)}, got {value!r}.")
    return float(value) if tp is float else value


def _build(cls: type, raw: Any, prefix: str, src: str) -> Any:
    where = f"`{prefix}`" if prefix else "the top level"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadInput(f"{src}: {where} must be a mapping of keys to values, got {raw!r}.")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    for k in raw:
        if k not in fields:
            known = ", ".join(fields)
            raise BadInput(
                f"{src}: unknown key `{prefix + '.' if prefix else ''}{k}` in {where}; "
                f"known keys there: {known}."
            )
    kwargs = {}
    for name, f in fields.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in raw:
            continue
        value = _coerce(raw[name], hints[name], key, src)
        check = f.metadata.get("check")
        if check is not None and value is not None:
            expected = check(value)
            if expected:
                raise BadInput(f"{src}: key `{key}` must be {expected}, got {raw[name]!r}.")
        kwargs[name] = value
    return cls(**kwargs)


def apply_override(raw: dict, assignment: str, src: str = "--set") -> None:
    """`sampling.temperature=0.7` -> raw["sampling"]["temperature"] = 0.7 (the value is parsed as YAML)."""
    if "=" not in assignment:
        raise BadInput(f"{src} {assignment!r}: expected KEY.PATH=VALUE, e.g. --set sampling.temperature=0.7.")
    path, text = assignment.split("=", 1)
    try:
        value = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        value = text
    keys = path.strip().split(".")
    node = raw
    for k in keys[:-1]:
        if not isinstance(node.get(k), dict):
            node[k] = {}
        node = node[k]
    node[keys[-1]] = value


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
    if (inp.parquet is None) == (inp.dataset is None):
        raise BadInput(
            f"{source}: key `input` must have exactly one of `input.parquet` (a file, directory or "
            f"glob) or `input.dataset` (path, name, split, data_dir); "
            f"{'both' if inp.parquet else 'neither'} given."
        )
    if inp.dataset is not None and not inp.dataset.path:
        raise BadInput(
            f"{source}: key `input.dataset.path` is missing; expected a save_to_disk directory, "
            f"a data-file builder name (parquet, json, csv) with data_dir, or a cached dataset id."
        )
    return spec


def load_job(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
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
        for a in overrides:
            apply_override(raw, a)
    return parse_job(raw, src)


def to_dict(spec: JobSpec) -> dict:
    d = dataclasses.asdict(spec)
    d.pop("source_file", None)
    return d
