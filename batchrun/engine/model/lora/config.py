"""A LoRA adapter's `adapter_config.json`, as PEFT saves it, read and checked without torch (`batchrun validate`
reads it too).

batchrun applies plain LoRA the way PEFT's `LoraModel` computes it when an adapter is loaded unmerged
(`PeftModel.from_pretrained(base, folder)`): each target linear layer adds `lora_B(lora_A(x)) * scaling` to its
base product, with `scaling = lora_alpha / r` (`lora_alpha / sqrt(r)` with `use_rslora`), a module's own alpha
from `alpha_pattern` and its own rank from `rank_pattern` (read from its weights' shapes). Every other setting
that changes what the adapter computes (DoRA's magnitudes, trained biases, modules saved whole, LoRA on raw
parameters, replicated layers, the variants PEFT adds over LoRA, initialisations that rewrite the base weights)
would make batchrun's rows silently differ from PEFT's, so each is refused, naming the file and key.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from batchrun.errors import BadInput

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")  # PEFT's save_pretrained, new and old

# settings whose default (any false value) is plain LoRA; set, batchrun would compute another function
_REFUSED = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "modules_to_save": "modules saved whole beside the adapter",
    "target_parameters": "LoRA on raw parameters (not linear layers)",
    "layer_replication": "replicated layers",
    "trainable_token_indices": "trained token embeddings",
    "lora_bias": "a trained bias on lora_B",
    "use_qalora": "QALoRA",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing",
    "fan_in_fan_out": "fan_in_fan_out (GPT-2's Conv1D layers)",
}
# initialisations that change the base model's weights when the adapter is made (PiSSA, OLoRA, ...): the
# adapter's weights then belong to a base batchrun does not have
_PLAIN_INITS = (True, False, "gaussian", None)


@dataclass(frozen=True)
class AdapterConfig:
    """What batchrun reads of an adapter's config: its rank and alpha, and the per-module overrides."""

    rank: int  # `r`: the rank of every module not in rank_pattern
    alpha: float  # `lora_alpha`
    rslora: bool = False  # `use_rslora`: scaling alpha / sqrt(r) instead of alpha / r
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    base_model: str | None = None  # `base_model_name_or_path`, as saved (said in errors, not compared)

    @property
    def max_rank(self) -> int:
        return max([self.rank, *self.rank_pattern.values()])

    def scaling(self, module: str, rank: int) -> float:
        """The factor PEFT multiplies module `module`'s `lora_B(lora_A(x))` by, for its rank `rank`."""
        alpha = self.alpha
        key = _pattern_key(self.alpha_pattern, module)
        if key is not None:
            alpha = self.alpha_pattern[key]
        return alpha / math.sqrt(rank) if self.rslora else alpha / rank


def _pattern_key(patterns: dict, module: str) -> str | None:
    """The first pattern naming `module` (a module name's tail, or a regular expression matching one), as PEFT
    looks up rank_pattern and alpha_pattern."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


def read_adapter_config(folder: Path, where: str, max_rank: int | None = None) -> AdapterConfig:
    """The adapter config in `folder`; BadInput naming `where` (the job key or argument that named the adapter),
    the file and the key, for a folder that is no LoRA adapter or an adapter batchrun does not apply exactly.
    `max_rank`: engine.max_lora_rank (None: no limit)."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise BadInput(f"{where}: {folder} has no {CONFIG_FILE}; expected a PEFT LoRA adapter folder")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BadInput(f"{where}: {path} is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise BadInput(f"{where}: {path} is not a JSON object")
    kind = raw.get("peft_type")
    if kind != "LORA":
        raise BadInput(f"{where}: {path}: key `peft_type` is {kind!r}; batchrun applies LoRA adapters only")
    for key, what in _REFUSED.items():
        if raw.get(key):
            raise BadInput(f"{where}: {path}: key `{key}`: {what} is not applied by batchrun")
    if raw.get("bias", "none") != "none":
        raise BadInput(
            f"{where}: {path}: key `bias` is {raw['bias']!r}: trained biases are not applied by batchrun"
        )
    init = raw.get("init_lora_weights", True)
    if init not in _PLAIN_INITS:
        raise BadInput(
            f"{where}: {path}: key `init_lora_weights` is {init!r}: that initialisation rewrites the base model's "
            "weights, which batchrun does not have"
        )
    rank, alpha = raw.get("r"), raw.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise BadInput(f"{where}: {path}: key `r` is {rank!r}; expected a positive integer")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise BadInput(f"{where}: {path}: key `lora_alpha` is {alpha!r}; expected a number")
    config = AdapterConfig(
        rank=rank,
        alpha=float(alpha),
        rslora=bool(raw.get("use_rslora")),
        rank_pattern=dict(raw.get("rank_pattern") or {}),
        alpha_pattern={k: float(v) for k, v in (raw.get("alpha_pattern") or {}).items()},
        base_model=raw.get("base_model_name_or_path"),
    )
    if max_rank is not None and config.max_rank > max_rank:
        raise BadInput(
            f"{where}: {path}: rank {config.max_rank} is over engine.max_lora_rank ({max_rank}); raise it to "
            "run this adapter"
        )
    return config
