"""Linear layers with their weights packed once for oneDNN, on the CPU.

A stock `nn.Linear` multiplies by its weight in PyTorch's plain row-major layout, and the matrix library
re-blocks it on every call; at a decode step's few dozen rows that costs more than the product. Reordered once
into oneDNN's blocked layout (what torch.compile's CPU freezing does to weights), a whole fp32 job ran
faster on the development machine (bench/RESULTS.md, with the command). bf16 results are bit for bit
those of `nn.Linear`; fp32 ones differ in the order of the sums (~1e-6 relative). Sibling layers called on one
input (q/k/v, gate/up) are packed as one product of their joined weights first (fused_linear.py).

Only a plain float weight is packed. A quantized checkpoint's linear layers (compressed-tensors, torchao,
bitsandbytes, GPTQ, FP8...) compute with their format's own arithmetic, through their own classes, tensor
subclasses or packed integer buffers, which oneDNN's reorder would either crash on or silently replace: a model
transformers loaded through a quantizer is left alone entirely (`quantized`), and any layer whose weight is not
a plain float tensor of a stock `nn.Linear` stays as it is (`plain_float_linear`).
"""

from __future__ import annotations

import functools
import re

import torch

from batchrun import host
from batchrun.engine.model.ops import fused_linear
from batchrun.engine.model.quantization import quantized

BATCH_HINT = 64  # rows the blocked layout is chosen for: a decode step's order of magnitude


class PackedLinear(torch.nn.Module):
    """`nn.Linear`'s forward on a weight reordered for oneDNN (the original module's weight is left alone: an
    LM head may share it with the embedding)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()  # see copy_out_of_the_load

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for oneDNN"


def available(dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` can be packed on this CPU: fp32 wherever oneDNN runs, bf16 only where its
    reorder has the instructions it needs (host.cpu_packs_bf16); elsewhere the layers stay `nn.Linear`."""
    if not torch.backends.mkldnn.is_available() or dtype not in (torch.float32, torch.bfloat16):
        return False
    return dtype == torch.float32 or host.cpu_packs_bf16()


def read_directly(model: torch.nn.Module) -> set[str]:
    """Names of child modules whose weight or bias the model's own code reads (`self.gate.weight.dtype`,
    `F.linear(x, self.classifier.weight)`): a PackedLinear has no plain weight to read, so those stay."""
    names: set[str] = set()
    for cls in {type(m) for m in model.modules()}:
        names |= _read_directly_by(cls)
    return names


@functools.cache
def _read_directly_by(cls: type) -> frozenset[str]:
    """Once per class (reading a class's source tokenizes its file)."""
    import inspect

    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return frozenset()
    return frozenset(re.findall(r"\.(\w+)\.(?:weight|bias)\b", source))


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def plain_tensor(t) -> bool:
    """A plain tensor or Parameter of a float dtype: not a tensor subclass (torchao's quantized tensors,
    bitsandbytes' Params4bit and Int8Params), not an integer or fp8 weight."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype in FLOAT_DTYPES


def plain_float_linear(module: torch.nn.Module) -> bool:
    """A stock `nn.Linear` (exactly that class: a quantized format's linear subclasses it) whose weight and bias
    are plain float tensors, with no quantization scheme attached (compressed-tensors attaches one to a stock
    `nn.Linear` and replaces its weight by packed integers)."""
    return (
        type(module) is torch.nn.Linear
        and plain_tensor(getattr(module, "weight", None))  # compressed-tensors' packed layers have none
        and (module.bias is None or plain_tensor(module.bias))
        and getattr(module, "quantization_scheme", None) is None
    )


def hooked(module: torch.nn.Module) -> bool:
    """Whether anything is attached to the module's calls (forward hooks or pre-hooks, accelerate's `_hf_hook`):
    replaced by a PackedLinear or a fused product's member, the module would no longer be called, and what is
    attached would silently stop seeing its calls."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or getattr(module, "_hf_hook", None) is not None
    )


def plain_linear(module) -> bool:
    """A layer whose output is always a new tensor of its own: a stock or packed linear layer, unhooked."""
    return type(module) in (torch.nn.Linear, PackedLinear) and not hooked(module)


def pack_linear_layers(model: torch.nn.Module, fuse: bool = True) -> int:
    """Replace every plain float `nn.Linear` of a CPU model by a PackedLinear (but those whose weight the
    model's code reads itself, and those with hooks); a quantized model's layers are never packed. With `fuse`,
    sibling layers the model calls on one input (q/k/v, gate/up: fused_linear.SIBLINGS), every one of them
    packable, become one packed product first. Returns how many products there are now in the place of linear
    layers (a fused group counts once)."""
    if quantized(model):
        return 0
    keep = read_directly(model)

    def packable(name: str, child: torch.nn.Module) -> bool:
        return plain_float_linear(child) and name not in keep and not hooked(child)

    # each group's concatenated weight made and packed, then its members' weights let go, one group at a time
    groups = fused_linear.fuse_siblings(model, packable, PackedLinear) if fuse else 0
    targets = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if packable(name, child)
    ]
    # one layer at a time, each float weight let go as soon as its packed copy is made (a model in memory of its
    # own is then held twice for one layer at most; a mapped checkpoint stays mapped until copy_out_of_the_load)
    for parent, name in targets:
        setattr(parent, name, PackedLinear(getattr(parent, name)))
    if targets or groups:
        copy_out_of_the_load(model)
    return len(targets) + groups


def copy_out_of_the_load(model: torch.nn.Module) -> None:
    """Copies the tensors left unpacked (embeddings, norms, the weights the model's code reads) into memory of
    their own. transformers loads a safetensors checkpoint by mapping the file, and while any tensor points
    into the map, every page of it that packing read stays resident beside the packed copies (the weights held
    twice: bench/RESULTS.md, the Qwen3-Embedding shape). A tied LM head is one parameter: copied once; a tensor
    subclass (a quantized format's) is left as it is."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if type(t) in (torch.Tensor, torch.nn.Parameter):
                t.data = t.data.clone()
