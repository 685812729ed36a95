"""A LoRA adapter's weights, read from its folder and checked against the model it is to adapt.

Every module the adapter names must be a plain float linear layer of the decoder whose input is the step's packed
tokens (`adaptable_linears`), with the shapes the adapter's weights have; anything else is a BadInput naming the
module (an adapter made for another base model, LoRA on the token embeddings, an LM head or an image encoder);
the same check (`adapter_layers`) runs before any weight loads on the model made on the meta device from its config
and the adapter file's tensor names and shapes (`check_adapter`), and at the load. The weights stay in CPU
memory (layers.py's `LoRAManager` loads them into slots), in the model's dtype, or fp32 for a half-precision model
as PEFT keeps them; a scaling that is a power of two rides on B.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from batchrun.engine.model.lora.config import WEIGHT_FILES, AdapterConfig
from batchrun.engine.model.structure import decoder_of
from batchrun.errors import BadInput

# a tensor's key: its module, and which of the adapter's tensors it is -- lora_A or lora_B of a linear layer, an
# embedding's lora_embedding_A or _B, or a base layer saved whole beside them (PEFT's save_embedding_layers)
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\."
    r"(?:lora_(?P<which>[AB])(?:\.[^.]+)?\.weight|lora_embedding_(?P<embedding>[AB])(?:\.[^.]+)?|base_layer\.weight)$"
)


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


def read_weights(folder: Path, where: str, shapes_only: bool = False) -> dict[str, dict[str, torch.Tensor]]:
    """{module: {"A": lora_A, "B": lora_B}} of an adapter folder's weights file (an embedding's pair as
    "embedding A"/"embedding B", a base layer saved whole as "base"); BadInput naming the key of any other tensor
    (a DoRA magnitude, a bias). `shapes_only`: tensors on the meta device, their names and shapes read from the
    file's header, no values (the check before the model loads)."""
    path = next((folder / f for f in WEIGHT_FILES if (folder / f).is_file()), None)
    if path is None:
        raise BadInput(f"{where}: {folder} has no adapter weights ({' or '.join(WEIGHT_FILES)})")
    try:
        if path.suffix != ".safetensors":
            tensors = torch.load(path, map_location="meta" if shapes_only else "cpu", weights_only=True)
        elif shapes_only:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                tensors = {k: torch.empty(f.get_slice(k).get_shape(), device="meta") for k in f.keys()}
        else:
            from safetensors.torch import load_file

            tensors = load_file(str(path))
    except Exception as e:
        raise BadInput(f"{where}: cannot read {path}: {e}") from None
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise BadInput(
                f"{where}: {path}: tensor {key!r} is not a LoRA A or B matrix; batchrun applies plain LoRA"
            )
        which = m["which"] or (f"embedding {m['embedding']}" if m["embedding"] else "base")
        modules.setdefault(m["module"], {})[which] = tensor
    if not modules:
        raise BadInput(f"{where}: {path} holds no LoRA weights")
    return modules


def adaptable_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The layers an adapter may target, by name: plain float `nn.Linear` layers inside the decoder, whose input
    is the step's packed tokens (the LM head sees only the tokens whose logits are kept, an image encoder its
    patches: LoRA there is refused), and whose weight the model's own code does not read."""
    from batchrun.engine.model.ops.cpu_linear import plain_float_linear, read_directly

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


def adapter_layers(
    model: torch.nn.Module, modules: dict[str, dict[str, torch.Tensor]], config: AdapterConfig, where: str
) -> dict[str, torch.nn.Linear]:
    """The layer of `model` each module of an adapter's weights (read_weights) adapts; BadInput naming the module
    for one `model` lacks, one batchrun does not adapt (the token embeddings, the LM head) or whose shape the
    weights do not fit. The one check of an adapter against a model: on the loaded model at its load, and before
    (`batchrun validate`, `submit`) on the model made on the meta device from its config (check_adapter)."""
    targets = adaptable_linears(model)
    layers = {}
    for module, pair in modules.items():
        layer = targets.get(module)
        if layer is None:
            found = model.get_submodule(module) if _has_module(model, module) else None
            kind = type(found).__name__
            why = (
                "is not in this model (an adapter for another base model?"
                + (f" it was made for {config.base_model})" if config.base_model else ")")
                if found is None
                else f"is {'an' if kind[0] in 'AEIOU' else 'a'} {kind} batchrun does not adapt (LoRA applies to "
                "the decoder's linear layers whose input is the step's tokens)"
            )
            raise BadInput(f"{where}: module {module!r} {why}")
        if set(pair) != {"A", "B"}:
            raise BadInput(
                f"{where}: module {module!r} has {' and '.join(sorted(pair))} weights; batchrun applies a pair of "
                "lora_A and lora_B"
            )
        a, b = pair["A"], pair["B"]
        rank = a.shape[0]
        if a.shape != (rank, layer.in_features) or b.shape != (layer.out_features, rank):
            raise BadInput(
                f"{where}: module {module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit its "
                f"{layer.in_features} -> {layer.out_features} layer (an adapter for another base model?)"
            )
        layers[module] = layer
    return layers


def check_adapter(folder: Path, config: AdapterConfig, model: torch.nn.Module, where: str) -> None:
    """Adapter `folder` against `model` (the model made on the meta device from its config) before any weight
    loads: its tensors' names and shapes alone (adapter_layers)."""
    adapter_layers(model, read_weights(folder, where, shapes_only=True), config, where)


def load_adapter(
    name: str, index: int, folder: Path, config: AdapterConfig, model: torch.nn.Module, where: str
) -> LoRAAdapter:
    """Adapter `name` read from `folder` and checked against `model` (adapter_layers). Its weights are kept in
    the model's dtype, but in float32 for a half-precision model, as PEFT keeps them (`autocast_adapter_dtype`)."""
    base_dtype = next(model.parameters()).dtype
    dtype = torch.float32 if base_dtype in (torch.float16, torch.bfloat16) else base_dtype
    modules = read_weights(folder, where)
    weights = {}
    for module in adapter_layers(model, modules, config, where):
        a, b = modules[module]["A"], modules[module]["B"]
        b, scaling = b.to(dtype).contiguous(), config.scaling(module, a.shape[0])
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
