"""What one attention layer computes beyond plain causal attention: fixed per layer at load (`LayerSpec`), and
the terms a call adds from each query token's own hidden state (`TokenScores`).

The load probe (architecture.inspect_model) reads every layer's call once (interface.read_call) and freezes it
into a LayerSpec: its KV cache group, whether it writes K/V, its mask kind, soft-capping, sinks (their fp32 copy
for the kernels made then), a query-scale fix, and the keyword arguments it was called with. Every later call
only checks that it passes the same keywords (`LayerSpec.matches`); anything else is read again and refused if
it asks for something other than what the pages were sized and the step planned for.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from batchrun.engine.attention.masks import MaskKind
from batchrun.errors import BadInput


class UnsupportedModel(BadInput):
    """The model asks of its attention something batchrun does not compute (raised at load by the probe)."""


def refusal(architecture: str, reason: str) -> UnsupportedModel:
    """The error refusing a model at load, naming its architecture and the reason."""
    return UnsupportedModel(f"model {architecture!r} cannot run on batchrun: {reason}")


class RelativeBias(NamedTuple):
    """A relative position bias by backward distance: `logits` [1, Hq, T, R], the bias each query token and head
    adds to the score of the key d = 0..R-1 positions back (none further). The model's own bias module computes
    it, asked for every distance (families.inkling_relative_bias), in place of the [T, T] bias it would build from
    the packed row's indices, which are not the tokens' positions."""

    logits: torch.Tensor


class ScoreTerms(NamedTuple):
    bias: torch.Tensor | None  # [B, Hq, n, m]: added to the scores before the mask
    sinks: torch.Tensor | None  # [B, Hq, n, 1]: each query's sink logit


@dataclass(frozen=True)
class TokenScores:
    """What a layer adds to each query token's scores from that token's own hidden state (Inkling 2)."""

    relative_bias: torch.Tensor | None  # [T, Hq, R]: at the key d = q_pos - k_pos back, for 0 <= d < R
    sinks: torch.Tensor | None  # [T, Hq]: a logit in the softmax's denominator, per token and head

    def terms(self, rows: torch.Tensor, back: torch.Tensor) -> ScoreTerms:
        """For a batch of B sequences of n queries each, at packed rows [B, n], over m keys, each key
        `back` [B, n, m] positions behind its query (query position - key position, built with the step's
        metadata): the bias [B, Hq, n, m] and the sinks [B, Hq, n, 1]."""
        bias = sinks = None
        if self.relative_bias is not None:
            rel = self.relative_bias[rows]  # [B, n, Hq, R]
            R = rel.shape[-1]
            index = back.clamp(0, R - 1)[:, :, None, :].expand(-1, -1, rel.shape[2], -1)
            bias = rel.gather(-1, index).masked_fill(((back < 0) | (back >= R))[:, :, None, :], 0.0)
            bias = bias.transpose(1, 2)
        if self.sinks is not None:
            sinks = self.sinks[rows].transpose(1, 2)[..., None]
        return ScoreTerms(bias, sinks)


class CallSignature(NamedTuple):
    """The keyword arguments of a layer's call as the probe saw them: the names given a value (not None or
    False), and the values of those that set what the layer computes (a tensor by identity)."""

    keywords: frozenset[str]
    constants: tuple[tuple[str, Any], ...]

    def matches(self, kwargs: dict) -> bool:
        given = {name for name, value in kwargs.items() if value is not None and value is not False}
        if given != self.keywords:
            return False
        for name, value in self.constants:
            now = kwargs[name]
            if now is not value and (isinstance(now, torch.Tensor) or now != value):
                return False
        return True


@dataclass(frozen=True)
class LayerCall:
    """What one layer's call asks beyond the mask: constants of the layer, and terms of each query token."""

    kind: MaskKind
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap), before the mask
    sinks: torch.Tensor | None = None  # [Hq]: one learned logit per head in the softmax's denominator
    # [Hq]: ALiBi, the head's slope times the key's position less the query's added to its score (a family
    # adapter passes it for a model that computes the bias in its own code: families.alibi_attention)
    alibi_slopes: torch.Tensor | None = None
    token_scores: TokenScores | None = None
    signature: CallSignature | None = field(default=None, compare=False)  # what the call was read from

    @property
    def plain(self) -> bool:
        """SDPA computes it (no soft-capping, no sinks, no ALiBi, nothing per token)."""
        return (
            self.softcap is None
            and self.sinks is None
            and self.alibi_slopes is None
            and self.token_scores is None
        )

    @property
    def positional(self) -> bool:
        """Its scores depend on each query's and key's positions (per-token terms, ALiBi): a step gives its
        queries' rows and how far behind them each key is (`terms`)."""
        return self.alibi_slopes is not None or self.token_scores is not None

    def terms(self, rows: torch.Tensor, back: torch.Tensor) -> ScoreTerms | None:
        """These queries' terms (TokenScores.terms, then ALiBi's -slope * back added to the bias); None for a
        layer without any."""
        terms = None if self.token_scores is None else self.token_scores.terms(rows, back)
        if self.alibi_slopes is None:
            return terms
        alibi = -self.alibi_slopes.view(1, -1, 1, 1) * back[:, None].to(self.alibi_slopes.dtype)
        if terms is None:
            return ScoreTerms(alibi, None)
        return terms._replace(bias=alibi if terms.bias is None else terms.bias + alibi)

    @property
    def sink_logits(self) -> torch.Tensor | None:
        """The sinks as the paged kernels take them: [Hq] (one per head) or [T, Hq] (per query token)."""
        token = self.token_scores
        return self.sinks if token is None or token.sinks is None else token.sinks

    @functools.cached_property
    def kernel_sinks(self) -> torch.Tensor | None:
        """`sink_logits` in fp32, contiguous (the C++ decode's form): made once for a layer's constant sinks."""
        sinks = self.sink_logits
        return None if sinks is None else sinks.detach().float().contiguous()

    @functools.cached_property
    def kernel_alibi_slopes(self) -> torch.Tensor | None:
        """The ALiBi slopes in fp32, contiguous (the C++ decode's form), made once for the layer."""
        slopes = self.alibi_slopes
        return None if slopes is None else slopes.detach().float().contiguous()

    @property
    def relative_bias(self) -> torch.Tensor | None:
        """[T, Hq, R] (TokenScores), as the paged kernels take it."""
        return None if self.token_scores is None else self.token_scores.relative_bias

    @property
    def kernel_relative_bias(self) -> torch.Tensor | None:
        """`relative_bias` in fp32, detached (the C++ decode's form)."""
        bias = self.relative_bias
        return None if bias is None else bias.detach().float()


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer, as fixed at load: where its K/V live and what its call computes."""

    layer: int
    group: int  # its KV cache group
    writes: bool  # False for a KV-shared layer (it reads the K/V an earlier layer of the step wrote)
    call: LayerCall  # mask kind, soft-capping, sinks, and the keywords the probe read them from
    token_terms: bool = False  # its calls carry per-token terms (TokenScores), read at each call
    scale_fix: Any = None  # families.QueryScaleFix: queries scaled by the packed row's index; None: none

    @property
    def kind(self) -> MaskKind:
        return self.call.kind

    @property
    def positional(self) -> bool:
        """Its scores depend on the queries' and keys' positions (LayerCall.positional; per-token terms)."""
        return self.token_terms or self.call.positional

    def matches(self, attention_mask, dropout: float, kwargs: dict) -> bool:
        """The call passes what the probe saw (then `call` holds for it)."""
        return attention_mask is None and not dropout and self.call.signature.matches(kwargs)
