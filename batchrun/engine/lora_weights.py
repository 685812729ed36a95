"""A LoRA adapter's weights, read from its folder and checked against the model it is to adapt.

Every module the adapter names must be a plain float linear layer of the decoder whose input is the step's packed
tokens (`adaptable_linears`), with the shapes the adapter's weights have; anything else is a BadInput naming the
module (an adapter made for another base model, LoRA on an LM head or an image encoder). The weights stay in CPU
memory (lora.py's `LoRAManager` loads them into slots), in the model's dtype, or fp32 for a half-precision model
as PEFT keeps them; a scaling that is a power of two rides on B.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import BadInput
from .kv_cache import decoder_of
from .lora_config import WEIGHT_FILES, AdapterConfig

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


@dataclass
class LoRAAdapter:
    """One adapter's weights: per target module (its name in the model), lora_A [r, in], lora_B [out, r] and the
    scaling PEFT applies."""

    name: str
    index: int  # its id: Sequence.adapter, the statistics' key
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b, _ in self.weights.values())

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _, _ in self.weights.values())


def read_weights(folder: Path, where: str) -> dict[str, dict[str, torch.Tensor]]:
    """{module: {"A": lora_A, "B": lora_B}} of an adapter folder's weights file; BadInput naming the key of any
    tensor that is not a LoRA A or B matrix (an embedding's, a DoRA magnitude, a bias)."""
    path = next((folder / f for f in WEIGHT_FILES if (folder / f).is_file()), None)
    if path is None:
        raise BadInput(f"{where}: {folder} has no adapter weights ({' or '.join(WEIGHT_FILES)})")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(str(path))
        else:
            tensors = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise BadInput(f"{where}: cannot read {path}: {e}") from None
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise BadInput(
                f"{where}: {path}: tensor {key!r} is not a LoRA A or B matrix; batchrun applies plain LoRA"
            )
        modules.setdefault(m["module"], {})[m["which"]] = tensor
    for module, pair in modules.items():
        if set(pair) != {"A", "B"}:
            raise BadInput(f"{where}: {path}: module {module!r} has lora_{next(iter(pair))} without its pair")
    if not modules:
        raise BadInput(f"{where}: {path} holds no LoRA weights")
    return modules


def adaptable_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The layers an adapter may target, by name: plain float `nn.Linear` layers inside the decoder, whose input
    is the step's packed tokens (the LM head sees only the tokens whose logits are kept, an image encoder its
    patches: LoRA there is refused), and whose weight the model's own code does not read."""
    from .cpu_linear import plain_float_linear, read_directly

    inside = {id(m) for m in decoder_of(model).modules()}
    read = read_directly(model)
    return {
        name: module
        for name, module in model.named_modules()
        if id(module) in inside
        and type(module) is torch.nn.Linear
        and plain_float_linear(module)
        and name.rsplit(".", 1)[-1] not in read
    }


def load_adapter(
    name: str, index: int, folder: Path, config: AdapterConfig, model: torch.nn.Module, where: str
) -> LoRAAdapter:
    """Adapter `name` read from `folder` and checked against `model` (BadInput naming the module otherwise). Its
    weights are kept in the model's dtype, but in float32 for a half-precision model, as PEFT keeps them
    (`autocast_adapter_dtype`)."""
    targets = adaptable_linears(model)
    base_dtype = next(model.parameters()).dtype
    dtype = torch.float32 if base_dtype in (torch.float16, torch.bfloat16) else base_dtype
    weights = {}
    for module, pair in read_weights(folder, where).items():
        layer = targets.get(module)
        if layer is None:
            found = model.get_submodule(module) if _has_module(model, module) else None
            why = (
                "is not in this model (an adapter for another base model?"
                + (f" it was made for {config.base_model})" if config.base_model else ")")
                if found is None
                else f"is a {type(found).__name__} batchrun does not adapt (LoRA applies to the decoder's "
                "linear layers whose input is the step's tokens)"
            )
            raise BadInput(f"{where}: module {module!r} {why}")
        a, b = pair["A"], pair["B"]
        rank = a.shape[0]
        if a.shape != (rank, layer.in_features) or b.shape != (layer.out_features, rank):
            raise BadInput(
                f"{where}: module {module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit its "
                f"{layer.in_features} -> {layer.out_features} layer (an adapter for another base model?)"
            )
        b, scaling = b.to(dtype).contiguous(), config.scaling(module, rank)
        if _power_of_two(scaling):  # folded into B: the same products bit for bit, one multiplication fewer
            b, scaling = b * scaling, 1.0
        weights[module] = (a.to(dtype).contiguous(), b, scaling)
    return LoRAAdapter(name, index, weights)


def _power_of_two(x: float) -> bool:
    """Whether multiplying by `x` only moves the exponent (exact: (B * x) y == (B y) * x in floating point, short
    of overflow), so a scaling of 2 (alpha = 2 r, the common choice) or 1 can ride on B."""
    return x > 0 and math.frexp(x)[0] == 0.5


def _has_module(model: torch.nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False
