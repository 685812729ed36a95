"""A decoder layer's two residual adds made in place by C++ (cpu_residual.cpp), the first in one call with the
post-attention RMSNorm where that norm is fused (bf16/fp16: fused_elementwise.py).

HF's Llama-style decoder layer adds its residual twice, after the attention and after the MLP, each time into a
new tensor, and normalizes the first sum by another call. Each sum is written here into the tensor it adds to:
the attention's output, then the MLP's, which their last products (`o_proj`, `down_proj`) have just made and
nothing but this add reads. The layer's input is never written (the model's loop, or a hook recording hidden
states, may hold it), and its output is the MLP's output tensor, which nothing writes afterwards. Each sum is
torch's (both values widened to fp32, added, rounded once to the dtype), so the values are HF's bit for bit in
every dtype, fp32 included; the norm is the fused norm's own.

Keyed on structure, as fused_elementwise.py is: a layer is taken only when its class's `forward` is, statement
for statement, Llama's (`LAYER_FORWARDS`: the Llama-style families' decoder layers copy it), its attention's
`forward` ends by returning `self.o_proj(attn_output)` and its MLP is Llama's (`KNOWN_MLPS`) or the fused one,
so both outputs are a product's new tensor: `o_proj` and `down_proj` plain or packed linear layers, nothing
hooked to the layer or its parts. The layer keeps its class and children; `forward` is set on the instance
(`restore` takes it off). Under autograd (grad mode on) the class's own forward runs: the C++ adds are not
recorded.
"""

from __future__ import annotations

import ast
import functools
import textwrap
import types

import torch

from batchrun.engine import cpu_kernels
from batchrun.engine.model.ops.cpu_linear import hooked, plain_linear
from batchrun.engine.model.ops.fused_elementwise import (
    KNOWN_MLPS,
    FusedRMSNorm,
    SiluAndMulMLP,
    forward_of,
    forward_source,
    statements,
)

LAYER_FORWARDS = (
    """
def forward(
    self,
    hidden_states,
    attention_mask=None,
    position_ids=None,
    cache=None,
    use_cache=False,
    position_embeddings=None,
    **kwargs,
):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    # Self Attention
    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states,
        attention_mask=attention_mask,
        position_ids=position_ids,
        cache=cache,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    hidden_states = residual + hidden_states

    # Fully Connected
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = residual + hidden_states
    return hidden_states
""",
)
KNOWN_LAYERS = {statements(s) for s in LAYER_FORWARDS}
ATTENTION_TAIL = "attn_output = self.o_proj(attn_output)\nreturn attn_output, attn_weights\n"
_TAIL = [ast.dump(s) for s in ast.parse(ATTENTION_TAIL).body]


def fused_forward(
    self,
    hidden_states,
    attention_mask=None,
    position_ids=None,
    cache=None,
    use_cache=False,
    position_embeddings=None,
    **kwargs,
):
    """LAYER_FORWARDS' statements with the two adds in place (installed on the layer as its `forward`)."""
    if torch.is_grad_enabled():
        hf = type(self).forward
        return hf(
            self, hidden_states, attention_mask, position_ids, cache, use_cache, position_embeddings, **kwargs
        )
    kernels = cpu_kernels.load()
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states,
        attention_mask=attention_mask,
        position_ids=position_ids,
        cache=cache,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    norm = self.post_attention_layernorm
    if isinstance(norm, FusedRMSNorm):
        normed = torch.empty_like(hidden_states, memory_format=torch.contiguous_format)
        if kernels.add_rms_norm(normed, hidden_states, residual, norm.weight, norm.variance_epsilon):
            residual = hidden_states
            hidden_states = normed
        else:
            hidden_states = residual = residual + hidden_states
            hidden_states = norm(hidden_states)
    else:
        if kernels.residual_add(hidden_states, residual):
            residual = hidden_states
        else:
            hidden_states = residual = residual + hidden_states
        hidden_states = norm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    if kernels.residual_add(hidden_states, residual):
        return hidden_states
    return residual + hidden_states


def attention_returns_o_proj(attention: torch.nn.Module) -> bool:
    return _ends_with_o_proj(type(attention).forward) and plain_linear(getattr(attention, "o_proj", None))


@functools.cache
def _ends_with_o_proj(forward) -> bool:
    """Once per function: the forward's last two statements are ATTENTION_TAIL (its source by `forward_source`,
    so none under a wrapper from outside transformers, which could keep or return the output the add reuses)."""
    source = forward_source(forward)
    if source is None:
        return False
    try:
        body = ast.parse(textwrap.dedent(source)).body[0].body
    except (SyntaxError, IndexError, AttributeError):
        return False
    return [ast.dump(s) for s in body[-2:]] == _TAIL


def mlp_returns_down_proj(mlp: torch.nn.Module) -> bool:
    known = isinstance(mlp, SiluAndMulMLP) or forward_of(mlp) in KNOWN_MLPS
    return known and not hooked(mlp) and plain_linear(getattr(mlp, "down_proj", None))


def layer_fits(layer: torch.nn.Module) -> bool:
    parts = [
        getattr(layer, n, None) for n in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
    ]
    return (
        forward_of(layer) in KNOWN_LAYERS
        and "forward" not in layer.__dict__
        and not hooked(layer)
        and all(p is not None and not hooked(p) for p in parts)
        and attention_returns_o_proj(layer.self_attn)
        and mlp_returns_down_proj(layer.mlp)
    )


def install(model: torch.nn.Module) -> int:
    """Give each decoder layer of a CPU model that fits the in-place adds; returns how many (0 where the
    kernels cannot be built here)."""
    if cpu_kernels.load() is None:
        return 0
    layers = [m for m in model.modules() if layer_fits(m)]
    for layer in layers:
        layer.forward = types.MethodType(fused_forward, layer)
    return len(layers)


def restore(model: torch.nn.Module) -> int:
    """Take the in-place adds off every layer that has them; returns how many."""
    layers = [
        m for m in model.modules() if getattr(m.__dict__.get("forward"), "__func__", None) is fused_forward
    ]
    for layer in layers:
        del layer.forward
    return len(layers)
