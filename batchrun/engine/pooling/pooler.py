"""A pooling job's settings (`PoolerConfig`, the job file's `pooler:` section and `LLM(runner="pooling",
pooler=...)`) and what they resolve to against the checkpoint (`PoolingPlan`): checked once, from config files
alone (no weights, no torch), so an impossible combination is a bad job (exit 2) before any model loads, and the
output's vector length is known for its schema.

The checkpoint decides (sentence_config.py); a key set here overrides it:
- `pooling`: cls | mean | max | mean_sqrt_len_tokens | weightedmean | lasttoken, in place of the checkpoint's;
- `normalize`: true: the final vector L2-normalised (after `dimensions`, as sentence-transformers'
  `encode(normalize_embeddings=True)`); false: the checkpoint's Normalize module left out; null: as the checkpoint;
- `dimensions`: the vector's first N components (Matryoshka), as sentence-transformers' `truncate_dim`;
- `prompt_name`: one of the checkpoint's named prompts, put before every text (tasks score and classify:
  before every pair's first text, as CrossEncoder.predict puts it) (null: its default_prompt_name; "": none);
- `truncate_prompt_tokens`: the most tokens a text keeps, cut at its end as sentence-transformers'
  `max_seq_length` cuts (in place of the checkpoint's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchrun.checks import at_least, check_fields, one_of
from batchrun.engine.pooling.sentence_config import POOLING_MODES, SentenceConfig, SentenceConfigError

TASKS = ("generate", "embed", "classify", "score", "reward")


@dataclass
class PoolerConfig:
    pooling: str | None = field(default=None, metadata={"check": one_of(*POOLING_MODES)})
    normalize: bool | None = None
    dimensions: int | None = field(default=None, metadata={"check": at_least(1)})
    prompt_name: str | None = None
    truncate_prompt_tokens: int | None = field(default=None, metadata={"check": at_least(1)})

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class PoolingPlan:
    """What a pooling job computes, resolved from the checkpoint and the job's `pooler:` keys."""

    modes: tuple[str, ...]
    include_prompt: bool
    after: tuple  # the checkpoint's Dense layers and "normalize", in its module order (normalize: false drops it)
    normalize_output: bool  # L2-normalise the final vector (pooler.normalize: true)
    dimensions: int | None  # keep the first N components
    prompt: str  # put before every text ("" for none)
    max_length: (
        int | None
    )  # the most tokens a text keeps (None: the model's own limit, and a longer text fails)
    output_dim: int  # the vector's length as written
    transformer_path: str  # the transformers model's folder inside the checkpoint
    # a pair's (task score, and classify of pairs), as CrossEncoder.predict makes it: the prompt put before its
    # first text, and the most tokens it keeps (None: max_length, else the tokenizer's limit)
    pair_prompt: str = ""
    pair_max_length: int | None = None


def prompt_of(sentence: SentenceConfig, prompt_name: str | None, where: str) -> str:
    """The prompt put before every text (an embedder's) or every pair's first text (a cross-encoder's), as
    sentence-transformers' `prompt_name` picks it: `prompt_name` (pooler.prompt_name) among the checkpoint's
    prompts, None its default_prompt_name, "" none; BadInput naming the key for a name it lacks."""
    name = sentence.default_prompt_name if prompt_name is None else prompt_name
    if name and name not in sentence.prompts:
        known = ", ".join(sorted(sentence.prompts)) or "none"
        raise SentenceConfigError(
            f"{where}: key `pooler.prompt_name`: the checkpoint has no prompt {name!r} (its prompts: {known})"
        )
    return sentence.prompts[name] if name else ""


def resolve(sentence: SentenceConfig, hidden_size: int, options: PoolerConfig, where: str) -> PoolingPlan:
    """The plan, or BadInput naming the key (`where`: the job file, or LLM(...)) for a combination the model
    cannot do."""
    modes = (options.pooling,) if options.pooling else sentence.modes
    if not sentence.from_files and options.pooling is None:
        raise SentenceConfigError(
            f"{where}: key `pooler.pooling`: the checkpoint has no sentence-transformers files (modules.json) to "
            f"say how it pools; set pooler.pooling to one of {', '.join(POOLING_MODES)}"
        )
    after = tuple(m for m in sentence.after if not (m == "normalize" and options.normalize is False))
    pooled = hidden_size * len(modes)
    dense = [m for m in after if m != "normalize"]
    if dense and dense[0].in_features != pooled:
        raise SentenceConfigError(
            f"{where}: key `pooler.pooling`: the checkpoint's Dense layer ({dense[0].folder.name}) takes "
            f"{dense[0].in_features} features, and pooling {'+'.join(modes)} gives {pooled}"
        )
    full = dense[-1].out_features if dense else pooled
    if options.dimensions is not None and options.dimensions > full:
        raise SentenceConfigError(
            f"{where}: key `pooler.dimensions`: {options.dimensions} is more than the model's {full} dimensions"
        )
    return PoolingPlan(
        modes=tuple(modes),
        include_prompt=sentence.include_prompt,
        after=after,
        normalize_output=bool(options.normalize),
        dimensions=options.dimensions,
        prompt=prompt_of(sentence, options.prompt_name, where),
        max_length=options.truncate_prompt_tokens or sentence.max_seq_length,
        output_dim=options.dimensions or full,
        transformer_path=sentence.transformer_path,
    )
