"""What the engine is told: the job file's `engine:` and `sampling:` sections, as the engine takes them.

These two dataclasses are the configuration chain's only links: the job-file parser builds them straight from
YAML (its key names are their field names), the Python API builds them from keyword arguments, and the engine
reads them as they are. A new option is one new field here, with its check; nothing copies it field by field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from ..checks import (
    FieldError,
    at_least,
    check_fields,
    in_range,
    one_of,
    power_of_two,
    size,
    size_or_fraction,
)


def _device(v: str) -> str | None:
    return None if v in ("auto", "cpu", "cuda") or str(v).startswith("cuda:") else "auto, cpu, cuda or cuda:N"


@dataclass
class EngineConfig:
    device: str = field(default="auto", metadata={"check": _device})
    attention: str = field(default="auto", metadata={"check": one_of("auto", "triton", "torch")})
    page_size: int = field(default=16, metadata={"check": power_of_two})
    # a fraction of free accelerator memory after loading the model (on the CPU: of a tenth of available RAM),
    # or a size such as "2GiB"
    kv_cache_memory: Union[float, str] = field(default=0.9, metadata={"check": size_or_fraction})  # noqa: UP007
    num_pages: int | None = field(default=None, metadata={"check": at_least(1)})  # overrides kv_cache_memory
    swap_space: Union[str, int] = field(default="4GiB", metadata={"check": size})  # noqa: UP007
    max_num_seqs: int = field(default=256, metadata={"check": at_least(1)})
    max_num_batched_tokens: int = field(default=8192, metadata={"check": at_least(1)})
    prefix_sharing: bool = True
    preemption: str = field(default="swap", metadata={"check": one_of("swap", "recompute")})

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = field(default=256, metadata={"check": at_least(0)})  # 0: score the prompt only
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        check_fields(self)
        if self.max_new_tokens == 0 and not (self.prompt_logprobs and self.n == 1):
            raise FieldError(
                "max_new_tokens", "0 makes a scoring job: it needs prompt_logprobs: true and n: 1"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
