"""Bloom's and MPT's ALiBi attention, computed in their own code, routed through batchrun's paged attention.

Why: their attention modules multiply queries by keys themselves and add ALiBi (a slope per head times the key's
position) from a tensor over the forward's own tokens, so they never reach transformers' attention interface and
their K/V are never paged (families.own_code_attention refuses such a module). This adapter replaces each such
module's forward, on the model's own instances, with one that computes q, k and v with the module's own
projections as its code does, attends through batchrun's attention function with the step's metadata and the
heads' slopes as the layer's `alibi_slopes` (a backend capability: -slope * (query position - key position) added
to each score, which differs from the model's bias by a constant per query, which the softmax drops), and
applies the module's own output projection and residual. The slopes are the model's own: its ALiBi builder asked
for two positions. MPT's model also calls `.to` on `create_causal_mask`'s result, which is None under an attention
function of one's own: its forward is given an empty 4-D mask, which `create_causal_mask` returns as it is and
which the routed attention never reads.

Checks at load: modules of the classes in ROUTES; refuses the model where such a module lacks an attribute its
route reads (the structure the route was written against), where its decoder lacks the ALiBi builder, or where
Bloom's `slow_but_exact` splits its output projection. Provides: `refusal`, `adapt_modules`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchrun.engine.attention import AttentionMetadata
from batchrun.engine.attention.interface import attention_forward
from batchrun.engine.model.families.adapter import FamilyAdapter
from batchrun.engine.model.structure import decoder_of, text_config


@dataclass(frozen=True)
class Route:
    attributes: tuple[str, ...]  # what `forward` reads of the module
    builder: str  # the decoder's ALiBi builder
    slopes: Callable  # (decoder, num_heads) -> [Hq] fp32, from the builder
    forward: Callable  # the module's forward, routed
    model_mask: bool = False  # the model's forward calls `.to` on create_causal_mask's result (MPT)


def attend(module, q, k, v, scale: float, dropout: float) -> torch.Tensor:
    """q, k, v [1, H, T, D] through batchrun's attention with the module's slopes: [1, T, H * D]."""
    out, _ = attention_forward(
        module, q, k, v, None, scaling=scale, dropout=dropout,
        alibi_slopes=module._batchrun_alibi_slopes, batchrun_attn=AttentionMetadata.current(),
    )  # fmt: skip
    return out.reshape(*out.shape[:2], -1)


def bloom_forward(self, hidden_states, residual, alibi=None, attention_mask=None, layer_past=None, **kwargs):
    """BloomAttention.forward's arithmetic, its scores and softmax in batchrun's attention."""
    q, k, v = self._reshape(self.query_key_value(hidden_states))
    context = attend(self, q, k, v, self.inv_norm_factor, self.attention_dropout.p if self.training else 0.0)
    output = F.dropout(self.dense(context), p=self.hidden_dropout, training=self.training)
    return output + residual, None


def mpt_forward(self, hidden_states, position_bias=None, cache=None, attention_mask=None, **kwargs):
    """MptAttention.forward's arithmetic, its scores and softmax in batchrun's attention."""
    batch_size, seq_length = hidden_states.shape[:2]
    mixed_qkv = self.Wqkv(hidden_states)
    if self.clip_qkv:
        mixed_qkv = mixed_qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    q, k, v = (
        x.reshape(batch_size, seq_length, self.n_heads, self.head_dim).transpose(1, 2)
        for x in mixed_qkv.chunk(3, dim=2)
    )
    context = attend(self, q, k, v, self.softmax_scale, self.attn_dropout_p if self.training else 0.0)
    return self.out_proj(context), None


# attention module class -> its route
ROUTES = {
    "BloomAttention": Route(
        ("query_key_value", "dense", "_reshape", "inv_norm_factor", "attention_dropout", "hidden_dropout"),
        "build_alibi_tensor",
        lambda decoder, heads: decoder.build_alibi_tensor(torch.ones(1, 2), heads, torch.float32)[:, 0, 1],
        bloom_forward,
    ),
    "MptAttention": Route(
        ("Wqkv", "out_proj", "clip_qkv", "n_heads", "head_dim", "softmax_scale", "attn_dropout_p"),
        "build_mpt_alibi_tensor",
        lambda decoder, heads: -decoder.build_mpt_alibi_tensor(heads, 2)[:, 0, 0].float(),
        mpt_forward,
        model_mask=True,
    ),
}
NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)  # MPT's model mask: read by no routed attention


class AlibiAttention(FamilyAdapter):
    name = "Bloom's and MPT's ALiBi attention in their own code"

    def refusal(self, model) -> str | None:
        decoder = decoder_of(model)
        for m in decoder.modules():
            route = ROUTES.get(type(m).__name__)
            if route is None:
                continue
            missing = [a for a in route.attributes if not hasattr(m, a)]
            if not hasattr(decoder, route.builder):
                missing.append(f"{type(decoder).__name__}.{route.builder}")
            if missing:
                return (
                    f"{type(m).__name__} computes its ALiBi attention in its own code, and lacks "
                    f"{', '.join(missing)}, which batchrun's route of it reads"
                )
            if getattr(m, "pretraining_tp", 1) > 1 and getattr(m, "slow_but_exact", False):
                return (
                    f"{type(m).__name__} splits its output projection in {m.pretraining_tp} parts "
                    "(slow_but_exact), which batchrun's route of it does not compute"
                )
        return None

    def adapt_modules(self, model) -> None:
        decoder = decoder_of(model)
        for m in decoder.modules():
            route = ROUTES.get(type(m).__name__)
            if route is None or "_batchrun_alibi_slopes" in m.__dict__:
                continue
            device = model.get_input_embeddings().weight.device  # the attention's linears may be packed
            m._batchrun_alibi_slopes = route.slopes(decoder, text_heads(model)).to(device, torch.float32)
            m.forward = route.forward.__get__(m)
            if route.model_mask and "_batchrun_mask_hook" not in decoder.__dict__:
                decoder._batchrun_mask_hook = decoder.register_forward_pre_hook(_no_mask, with_kwargs=True)


def text_heads(model) -> int:
    """The query heads of the model's attention (Bloom's `n_head`, MPT's `n_heads`, as their configs map them)."""
    return text_config(model.config).num_attention_heads


def _no_mask(module, args, kwargs):
    """MPT's model forward given the empty 4-D mask where it has none (see the module's docstring)."""
    if kwargs.get("attention_mask") is None:
        kwargs["attention_mask"] = NO_MASK.to(module.get_input_embeddings().weight.device)
    return args, kwargs


ADAPTER = AlibiAttention()
