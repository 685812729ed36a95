"""A BERT-style encoder block's elementwise work carried by its packed products, on the CPU (pooling jobs).

BERT and the families that copy its blocks (RoBERTa, XLM-R) compute the MLP's first half as
`act(dense(x))` and each sub-block's end as `LayerNorm(dropout(dense(h)) + input)`. Run as HF writes them, the
GELU and the residual add are each a pass of their own over the product's output; oneDNN computes both inside the
product instead, as post-ops applied to each tile while it is in cache (`_linear_pointwise` with "gelu", and its
`binary` form with "add"). In bf16 the product's fp32 sums reach the GELU or the add before they are rounded to
bf16 once, where HF's code rounds them first, a difference of a unit in the last bf16 place
(tests/test_fused_encoder.py holds them to the bf16 tolerance). In fp32 a post-op's result is within an fp32 unit
of HF's separate operations' but not always equal to it (the same test), so a pooling job in fp32, which is held
to HF bit for bit, does not take them (prepare.py fuses bf16/fp16 models only).

Keyed on the module's structure at load, as fused_elementwise.py keys its modules: a module is replaced only when
its class's `forward` is, statement for statement, BERT's (`INTERMEDIATE_FORWARDS`, `OUTPUT_FORWARDS`), its
`dense` was packed for oneDNN (cpu_linear.PackedLinear: a weight the model reads itself, a quantized or hooked
layer, stays `nn.Linear` and the module stays HF's), its activation torch's erf GELU,
its norm a stock `nn.LayerNorm`, and nothing is hooked to any of them. `restore` puts HF's modules back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.activations import GELUActivation

from batchrun.engine.model.ops import fused_elementwise
from batchrun.engine.model.ops.cpu_linear import PackedLinear, hooked
from batchrun.engine.model.ops.fused_elementwise import forward_of, statements

INTERMEDIATE_FORWARDS = (
    """
def forward(self, hidden_states):
    hidden_states = self.dense(hidden_states)
    hidden_states = self.intermediate_act_fn(hidden_states)
    return hidden_states
""",
)
OUTPUT_FORWARDS = (
    """
def forward(self, hidden_states, input_tensor):
    hidden_states = self.dense(hidden_states)
    hidden_states = self.dropout(hidden_states)
    hidden_states = self.LayerNorm(hidden_states + input_tensor)
    return hidden_states
""",
)
KNOWN_INTERMEDIATES = {statements(s) for s in INTERMEDIATE_FORWARDS}
KNOWN_OUTPUTS = {statements(s) for s in OUTPUT_FORWARDS}


def exact_gelu(act: torch.nn.Module) -> bool:
    """The activation is torch's erf GELU (HF's ACT2FN["gelu"], or `nn.GELU()`), unhooked: oneDNN's erf GELU
    post-op computes it bit for bit in fp32. Not the tanh approximation, whose post-op differs from torch's in
    the last fp32 place; not HF's Python formulas, nor a hub kernel in the place of torch's."""
    if hooked(act):
        return False
    if type(act) is torch.nn.GELU:
        return act.approximate == "none"
    return type(act) is GELUActivation and getattr(act, "act", None) is F.gelu


def packed_dense(module: torch.nn.Module) -> bool:
    dense = getattr(module, "dense", None)
    return type(dense) is PackedLinear and not hooked(dense)


class DenseGELU(torch.nn.Module):
    """`act(dense(x))` as one oneDNN product with an erf GELU post-op; `dense` stays the module's child."""

    def __init__(self, hf: torch.nn.Module):
        super().__init__()
        self.dense, self.intermediate_act_fn = hf.dense, hf.intermediate_act_fn
        self._hf = [hf]  # in a list: no child (its parameters are counted once, under this module's names)
        self.train(hf.training)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dense = self.dense
        if hidden_states.dtype != dense.packed.dtype or hidden_states.requires_grad:
            return self.intermediate_act_fn(dense(hidden_states))  # HF's statements
        return torch.ops.mkldnn._linear_pointwise(hidden_states, dense.packed, dense.bias, "gelu", [], "none")

    def extra_repr(self) -> str:
        return "erf GELU as the product's post-op"


class DenseAddNorm(torch.nn.Module):
    """`LayerNorm(dropout(dense(h)) + input)` of a model in eval mode: the residual add as the product's
    post-op, then the LayerNorm; `dense`, `dropout` and `LayerNorm` stay the module's children."""

    def __init__(self, hf: torch.nn.Module):
        super().__init__()
        self.dense, self.dropout, self.LayerNorm = hf.dense, hf.dropout, hf.LayerNorm
        self._hf = [hf]
        self.train(hf.training)  # a new module is in training mode: the model's, as it was loaded

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        dense = self.dense
        if (
            self.training  # dropout drops
            or hidden_states.dtype != dense.packed.dtype
            or input_tensor.dtype != hidden_states.dtype
            or input_tensor.shape[:-1] != hidden_states.shape[:-1]
            or hidden_states.requires_grad
        ):
            return self.LayerNorm(self.dropout(dense(hidden_states)) + input_tensor)  # HF's statements
        summed = torch.ops.mkldnn._linear_pointwise.binary(
            hidden_states, input_tensor.contiguous(), dense.packed, dense.bias, "add"
        )
        return self.LayerNorm(summed)

    def extra_repr(self) -> str:
        return "residual add as the product's post-op, then LayerNorm"


def intermediate_fits(module: torch.nn.Module) -> bool:
    return (
        packed_dense(module)
        and not hooked(module)
        and forward_of(module) in KNOWN_INTERMEDIATES
        and exact_gelu(module.intermediate_act_fn)
    )


def output_fits(module: torch.nn.Module) -> bool:
    norm, dropout = getattr(module, "LayerNorm", None), getattr(module, "dropout", None)
    return (
        packed_dense(module)
        and type(norm) is torch.nn.LayerNorm
        and type(dropout) is torch.nn.Dropout
        and not any(hooked(m) for m in (module, norm, dropout))
        and forward_of(module) in KNOWN_OUTPUTS
    )


def fuse(model: torch.nn.Module) -> int:
    """Replace the BERT-style intermediates and outputs of a CPU model whose products are packed that fit by
    their fused versions; returns how many were replaced."""
    swaps = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if intermediate_fits(child):
                swaps.append((parent, name, DenseGELU(child)))
            elif output_fits(child):
                swaps.append((parent, name, DenseAddNorm(child)))
    for parent, name, fused in swaps:
        setattr(parent, name, fused)
    return len(swaps)


def restore(model: torch.nn.Module) -> int:
    """Put HF's modules back in the place of the fused ones; returns how many."""
    return fused_elementwise.restore(model, (DenseGELU, DenseAddNorm))
