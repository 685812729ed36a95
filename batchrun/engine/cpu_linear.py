"""Linear layers with their weights packed once for oneDNN, on the CPU.

A stock `nn.Linear` multiplies by its weight in PyTorch's plain row-major layout, and the matrix library
re-blocks it on every call; at a decode step's few dozen rows that costs more than the product. Reordered once
into oneDNN's blocked layout (what torch.compile's CPU freezing does to weights), a whole fp32 job ran
faster on the development machine (bench/RESULTS.md, with the command). bf16 results are bit for bit
those of `nn.Linear`; fp32 ones differ in the order of the sums (~1e-6 relative).
"""

from __future__ import annotations

import re

import torch

from .. import host

BATCH_HINT = 64  # rows the blocked layout is chosen for: a decode step's order of magnitude


class PackedLinear(torch.nn.Module):
    """`nn.Linear`'s forward on a weight reordered for oneDNN (the original module's weight is left alone: an
    LM head may share it with the embedding)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()

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
    import inspect

    names: set[str] = set()
    for cls in {type(m) for m in model.modules()}:
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        names |= set(re.findall(r"\.(\w+)\.(?:weight|bias)\b", source))
    return names


def pack_linear_layers(model: torch.nn.Module) -> int:
    """Replace every `nn.Linear` of a CPU model by a PackedLinear (but those whose weight the model's code
    reads itself); returns how many."""
    keep = read_directly(model)
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear and name not in keep
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)


def prepare(model: torch.nn.Module, dtype: torch.dtype, pack: bool) -> bool:
    """A CPU model's setup before its first forward: freed memory blocks kept for reuse (cpu_allocator), and its
    linear weights packed when `pack` (engine.pack_weights) and this CPU can; returns whether any were."""
    from . import cpu_allocator

    cpu_allocator.keep_freed_blocks()
    return pack and available(dtype) and pack_linear_layers(model) > 0
