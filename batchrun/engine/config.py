"""What the engine is told: the job file's `engine:` and `sampling:` sections, as the engine takes them.

These two dataclasses are the configuration chain's only links: the job-file parser builds them straight from
YAML (its key names are their field names), the Python API builds them from keyword arguments, and the engine
reads them as they are. A new option is one new field here, with its check; nothing copies it field by field.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field, fields
from typing import Any, Union

from batchrun.checks import (
    FieldError,
    TypeMismatch,
    at_least,
    check_fields,
    coerce,
    field_error,
    in_range,
    one_of,
    power_of_two,
    size,
    size_or_fraction,
)
from batchrun.engine.backend_registry import REGISTRY


def _device(v: str) -> str | None:
    return None if v in ("auto", "cpu", "cuda") or str(v).startswith("cuda:") else "auto, cpu, cuda or cuda:N"


FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "choice", "grammar")


def check_response_format(rf: Any) -> str | None:
    """The shape of a response format (no compiling): None when fine, else what was expected."""
    if not isinstance(rf, dict) or rf.get("type") not in FORMAT_TYPES:
        return (
            "a mapping {type: text | json_object | json_schema | regex | choice | grammar, ...}: json_schema with "
            "json_schema: {name, schema, strict}, regex with regex: '...', choice with choices: [...], grammar "
            "with grammar: '<EBNF>'"
        )
    kind = rf["type"]
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict | bool):
            return "a json_schema format with json_schema: {name, schema: {...}, strict}"
    elif kind == "regex" and not isinstance(rf.get("regex"), str):
        return "a regex format with regex: '<a regular expression>'"
    elif kind == "choice":
        choices = rf.get("choices")
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            return "a choice format with choices: a non-empty list of non-empty strings"
    elif kind == "grammar" and not isinstance(rf.get("grammar"), str):
        return "a grammar format with grammar: '<EBNF, root rule first>'"
    return None


def _replicas(v: int | str) -> str | None:
    ok = v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1)
    return None if ok else "a number >= 1 or auto"


@dataclass
class EngineConfig:
    device: str = field(default="auto", metadata={"check": _device})
    # auto, or a backend's name as the backends' registry has them (backend_registry.py: torch-free)
    attention: str = field(default="auto", metadata={"check": one_of("auto", *REGISTRY)})
    page_size: int = field(default=16, metadata={"check": power_of_two})
    # a fraction of free accelerator memory after loading the model (on the CPU: of a tenth of available RAM),
    # or a size such as "2GiB"
    kv_cache_memory: Union[float, str] = field(default=0.9, metadata={"check": size_or_fraction})  # noqa: UP007
    num_pages: int | None = field(default=None, metadata={"check": at_least(1)})  # overrides kv_cache_memory
    # CPU memory for swapped-out pages; None (unset): what fits this machine at start (sizing.swap_bytes)
    swap_space: Union[str, int, None] = field(default=None, metadata={"check": size})  # noqa: UP007
    max_num_seqs: int = field(default=256, metadata={"check": at_least(1)})
    max_num_batched_tokens: int = field(default=8192, metadata={"check": at_least(1)})
    prefix_sharing: bool = True
    # CPU: linear weights reordered once into oneDNN's blocked layout (engine/model/ops/cpu_linear.py)
    pack_weights: bool = True
    preemption: str = field(default="swap", metadata={"check": one_of("swap", "recompute")})
    # LoRA adapters (engine/model/lora/layers.py): how many one step may run (their weights in as many slots beside the model;
    # the others wait in CPU memory), and the largest rank an adapter may have
    max_loras: int = field(default=4, metadata={"check": at_least(1)})
    max_lora_rank: int = field(default=64, metadata={"check": at_least(1)})
    # engine processes on this machine sharing a run's rows (the job runner's, not one engine's): a count, or
    # auto = one per visible GPU
    replicas: Union[int, str] = field(default=1, metadata={"check": _replicas})  # noqa: UP007

    def __post_init__(self) -> None:
        check_fields(self)


DEFAULT_MAX_NEW_TOKENS = 256


@dataclass(frozen=True)
class SamplingParams:
    # 0: score the prompt only; None (not given): max_tokens, else DEFAULT_MAX_NEW_TOKENS
    max_new_tokens: int | None = field(default=None, metadata={"check": at_least(0)})
    temperature: float = field(default=0.0, metadata={"check": at_least(0)})
    top_p: float = field(default=1.0, metadata={"check": in_range(0, 1, open_low=True)})
    top_k: int = field(default=-1, metadata={"check": lambda v: None if v == -1 or v >= 1 else "-1 or >= 1"})
    seed: int = 0
    stop: tuple[str, ...] = ()  # stop strings, cut from the completion
    n: int = field(default=1, metadata={"check": at_least(1)})  # samples per prompt, sharing its pages
    ignore_eos: bool = False
    # log-probabilities of each generated token and of the K most likely there, from the raw logits
    logprobs: int | None = field(default=None, metadata={"check": in_range(0, 20)})
    prompt_logprobs: bool = False  # log p(token_i | tokens before it) for every prompt token
    # structured output (engine/structured.py): the allowed-token mask of a grammar, before sampling
    response_format: dict[str, Any] | None = field(default=None, metadata={"check": check_response_format})
    # vLLM's name for max_new_tokens, taken as it (a keyword and a job-file key, never a field of its own)
    max_tokens: InitVar[int | None] = None

    def __post_init__(self, max_tokens: int | None = None) -> None:
        object.__setattr__(self, "max_new_tokens", _max_new_tokens(self.max_new_tokens, max_tokens))
        if self.stop is None:  # as vLLM's SamplingParams takes it: no stop strings
            object.__setattr__(self, "stop", ())
        check_fields(
            self
        )  # types as the job file's parser checks them (a string or a list: a tuple), then values
        if self.max_new_tokens == 0 and not (self.prompt_logprobs and self.n == 1):
            raise FieldError(
                "max_new_tokens", "0 makes a scoring job: it needs prompt_logprobs: true and n: 1"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain(self) -> bool:
        """Greedy, with no grammar, no logprobs and no stop strings: a decode of such a request is one argmax and
        the EOS and length checks (OutputProcessor.sample, Scheduler.update_from_output). A new field that changes how a
        token is sampled or when a sequence finishes must make this False where it applies."""
        return self.greedy and self.logprobs is None and not self.stop and not self.structured

    @property
    def structured(self) -> bool:
        return self.response_format is not None and self.response_format.get("type") != "text"


def _max_new_tokens(max_new_tokens: int | None, max_tokens: int | None) -> int:
    """The one token limit of SamplingParams(max_new_tokens=..., max_tokens=...): whichever was given (both:
    only when they agree), else the default. FieldError naming max_tokens for a value max_new_tokens refuses."""
    if max_tokens is None:
        return DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens
    limit = next(f for f in fields(SamplingParams) if f.name == "max_new_tokens")
    try:
        value = coerce(max_tokens, int, "max_tokens")
    except TypeMismatch as e:
        raise FieldError("max_tokens", f"must be {e.expected}, got {max_tokens!r}") from None
    expected = field_error(limit, value)
    if expected:
        raise FieldError("max_tokens", f"must be {expected}, got {max_tokens!r}")
    if max_new_tokens is not None and max_new_tokens != value:
        raise FieldError(
            "max_tokens",
            f"{value} and max_new_tokens {max_new_tokens} are both given; they are one setting (max_tokens is "
            "vLLM's name for it): give one",
        )
    return value
