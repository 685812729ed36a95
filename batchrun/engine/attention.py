"""batchrun's attention inside stock `transformers` models.

The model runs on one packed row of every token scheduled this step. `transformers` calls the function
registered here once per layer, with q [1, Hq, T, D] and k/v [1, Hkv, T, D] after RoPE; the step's
`AttentionMetadata` arrives as the `batchrun_attn` keyword. The function writes the new K/V into their page
slots (slot mapping) and attends through the block tables, with one of three backends, each an object chosen
once per engine (`make_backend`):
- `TorchAttention` (`torch`, the CPU default): decoding sequences through batchrun's C++ extension, which reads
  K/V in the pages (`cpu_kernels.cpp`), prompts through SDPA;
- `GatherAttention` (`gather`): plain PyTorch, gathering each group's pages into a padded batch for SDPA (what
  `torch` falls back to where the C++ kernel cannot be built, or on a GPU, and what the kernel was measured
  against: bench/RESULTS.md);
- `TritonAttention` (the GPU default): the paged kernels in `batchrun_kernels`, which read K/V in the pages.
A backend builds its metadata once per step and mask kind (`prepare`, from host integers: nothing in the
forward waits on the device to learn a shape), and every layer of that kind runs from it (`forward`).

What a layer computes beyond plain causal attention arrives with its call and is honoured by every backend:
a sliding window (`sliding_window`: Mistral, Gemma 2/3, gpt-oss, ...), chunked attention (Llama 4's local
layers, from the config's `layer_types`), logit soft-capping (`softcap`: Gemma 2) and attention sinks (`s_aux`:
gpt-oss), and terms of each query token's own (`TokenScores`: Inkling 2's sink logits and relative position
bias, computed from the token's hidden state). An argument batchrun does not know is an error
(`UnsupportedModel`), never ignored: the engine's load probe (architecture.py) meets it before any row runs.
"""

from __future__ import annotations

import array
import contextlib
import functools
import math
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ..errors import BadInput
from .page_pool import cdiv

ATTENTION_NAME = "batchrun_paged"
_ARRAY_TYPECODES = {torch.int64: "q", torch.int32: "i"}


def int_tensor(values: list[int], dtype: torch.dtype = torch.long, device: torch.device | None = None):
    """A 1-D integer tensor of Python ints, through an `array.array`'s buffer: faster than `torch.tensor`, which
    converts one element at a time (bench/RESULTS.md), and a step builds several from lists."""
    if not values:
        return torch.empty(0, dtype=dtype, device=device)
    t = torch.frombuffer(array.array(_ARRAY_TYPECODES[dtype], values), dtype=dtype)
    return t if device is None or device.type == "cpu" else t.to(device)


def padded_int_tensor(rows: list[list[int]], width: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """[len(rows), width]: each row padded with 0 (block tables)."""
    flat: list[int] = []
    zeros = [0] * width
    for r in rows:
        flat += r
        flat += zeros[len(r) :]
    return int_tensor(flat, dtype, device).view(len(rows), width)


class UnsupportedModel(BadInput):
    """The model asks of its attention something batchrun does not compute (raised at load by the probe)."""


@dataclass(frozen=True)
class MaskKind:
    """Which earlier keys a query at position p sees: all (full causal), the last `window` (sliding window:
    p - window < k <= p, as transformers' masks have it) or those of its own chunk (k // chunk == p // chunk)."""

    window: int | None = None
    chunk: int | None = None

    @property
    def is_full(self) -> bool:
        return self.window is None and self.chunk is None

    def first_key(self, pos: int) -> int:
        """The first key position a query at `pos` sees."""
        if self.window is not None:
            return max(0, pos - self.window + 1)
        if self.chunk is not None:
            return pos - pos % self.chunk
        return 0

    def visible(
        self, query_pos: torch.Tensor, key_pos: torch.Tensor, images: list[tuple[int, int]] | None = None
    ) -> torch.Tensor:
        """[n, m] bool: query_pos [n] sees key_pos [m]. `images`: (start, end) positions of images whose tokens
        see each other (multimodal.ImageBlocks), later ones included, within the window or chunk."""
        q, k = query_pos[:, None], key_pos[None, :]
        seen = k <= q
        if images:
            qi, ki = _image_of(query_pos, images)[:, None], _image_of(key_pos, images)[None, :]
            seen |= (qi == ki) & (qi >= 0)
        if self.window is not None:
            seen &= k > q - self.window
        if self.chunk is not None:
            seen &= k // self.chunk == q // self.chunk
        return seen


FULL = MaskKind()


def _image_of(pos: torch.Tensor, images: list[tuple[int, int]]) -> torch.Tensor:
    """[n] the index of the image each position is a token of, -1 for none."""
    which = torch.full_like(pos, -1)
    for j, (start, end) in enumerate(images):
        which[(pos >= start) & (pos < end)] = j
    return which


class RelativeBias(NamedTuple):
    """A relative position bias by backward distance: `logits` [1, Hq, T, R], the bias each query token and head
    adds to the score of the key d = 0..R-1 positions back (none further). The model's own bias module computes
    it, asked for every distance (architecture.RELATIVE_BIAS), in place of the [T, T] bias it would build from
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

    def terms(self, rows: torch.Tensor, query_pos: torch.Tensor, num_keys: int) -> ScoreTerms:
        """For a batch of B sequences of n queries each, at packed rows and positions [B, n], over the keys at
        positions 0..num_keys-1 (m): the bias [B, Hq, n, m] and the sinks [B, Hq, n, 1]."""
        bias = sinks = None
        if self.relative_bias is not None:
            rel = self.relative_bias[rows]  # [B, n, Hq, R]
            R = rel.shape[-1]
            key_pos = torch.arange(num_keys, device=query_pos.device)
            back = query_pos[:, :, None] - key_pos[None, None, :]  # [B, n, m]
            index = back.clamp(0, R - 1)[:, :, None, :].expand(-1, -1, rel.shape[2], -1)
            bias = rel.gather(-1, index).masked_fill(((back < 0) | (back >= R))[:, :, None, :], 0.0)
            bias = bias.transpose(1, 2)
        if self.sinks is not None:
            sinks = self.sinks[rows].transpose(1, 2)[..., None]
        return ScoreTerms(bias, sinks)


@dataclass(frozen=True)
class LayerCall:
    """What one layer's call asks beyond the mask: constants of the layer, and terms of each query token."""

    kind: MaskKind
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap), before the mask
    sinks: torch.Tensor | None = None  # [Hq]: one learned logit per head in the softmax's denominator
    token_scores: TokenScores | None = None

    @property
    def plain(self) -> bool:
        """SDPA computes it (no soft-capping, no sinks, nothing per token)."""
        return self.softcap is None and self.sinks is None and self.token_scores is None

    def terms(self, rows: torch.Tensor, query_pos: torch.Tensor, num_keys: int) -> ScoreTerms | None:
        """These queries' per-token terms (TokenScores.terms); None for a layer without any."""
        return None if self.token_scores is None else self.token_scores.terms(rows, query_pos, num_keys)

    @property
    def sink_logits(self) -> torch.Tensor | None:
        """The sinks as the paged kernels take them: [Hq] (one per head) or [T, Hq] (per query token)."""
        token = self.token_scores
        return self.sinks if token is None or token.sinks is None else token.sinks

    @property
    def relative_bias(self) -> torch.Tensor | None:
        """[T, Hq, R] (TokenScores), as the paged kernels take it."""
        return None if self.token_scores is None else self.token_scores.relative_bias


@dataclass
class StepLayout:
    """What every backend builds its metadata from, for one KV cache group: one entry per scheduled sequence,
    in packed order."""

    query_lens: list[int]  # tokens computed for it this step
    context_lens: list[int]  # its context after this step (new tokens included)
    block_tables: list[list[int]]  # the group's tables (NULL_PAGE = -1 where a page fell behind the window)
    slot_mapping: torch.Tensor  # [T] int64: cache slot (page * page_size + offset) of each new token
    page_size: int
    # per sequence: the (start, end) positions of the images among its queries whose tokens see each other
    # (multimodal.ImageBlocks, on the layers it opens); None: no such image this step
    image_blocks: list[list[tuple[int, int]]] | None = None

    @functools.cached_property
    def slot_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] page and [T] offset in it of each new token's slot: where `write_kv` puts its K/V."""
        return self.slot_mapping // self.page_size, self.slot_mapping % self.page_size


@dataclass
class DecodeBatch:
    """The step's decoding sequences (one query token each), attended together over their gathered pages."""

    token_index: torch.Tensor  # [G] packed-token index of each sequence's query
    query_pos: torch.Tensor  # [G] each one's query position (its context - 1)
    page_index: torch.Tensor  # [G * num_blocks] block tables, flattened (padded with page 0)
    mask: torch.Tensor  # [G, 1, 1, num_blocks * page_size] bool: key j is in the sequence's context
    num_blocks: int


@dataclass
class PrefillSequence:
    """One sequence computing several tokens: a prompt, a chunk of one, or a prompt behind cached pages."""

    start: int  # first packed-token index of its queries
    num_tokens: int
    context_len: int  # tokens it attends to, its new ones included
    pages: torch.Tensor | None  # [num_blocks] its block table, when earlier tokens live in the cache
    mask: torch.Tensor | None  # [1, 1, num_tokens, num_blocks * page_size], causal at the right offset


class Workspace:
    """Buffers reused by every layer and step: fresh large tensors each call cost page faults on the CPU."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(max(numel, 1), dtype=like.dtype, device=like.device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)


def split_step(layout: StepLayout, kind: MaskKind, page_size: int, device: torch.device):
    """The decoding sequences as (packed row of the query, index), and a PrefillSequence for every other one:
    each is attended on its own, so a long prompt pads nothing else."""
    decode_rows, prefills = [], []
    start = 0
    for i, (q, c) in enumerate(zip(layout.query_lens, layout.context_lens)):
        if q == 1:
            decode_rows.append((start, i))
        else:
            pages = mask = key_pos = None
            query_pos = torch.arange(c - q, c, device=device)
            images = layout.image_blocks[i] if layout.image_blocks is not None else None
            if c > q:  # earlier tokens are in the cache: read them through the block table
                num_blocks = cdiv(c, page_size)
                # a page behind the window (NULL) is masked: page 0 stands in for it
                pages = torch.tensor(layout.block_tables[i][:num_blocks], device=device).clamp_(min=0)
                key_pos = torch.arange(num_blocks * page_size, device=device)
            elif images or not kind.is_full:  # a whole prompt, under a window, chunks or images: not causal
                key_pos = query_pos
            if key_pos is not None:
                mask = kind.visible(query_pos, key_pos, images)[None, None]
            prefills.append(PrefillSequence(start, q, c, pages, mask))
        start += q
    return decode_rows, prefills


def _buckets_by_length(
    rows: list[tuple[int, int]], context_lens: list[int], page_size: int, slack: float = 0.8
) -> list[list[tuple[int, int]]]:
    """Split decoding rows into groups of similar context length: each group is padded to its longest context,
    and one padded group of very different lengths reads (and attends over) up to several times the K/V."""
    ordered = sorted(rows, key=lambda r: context_lens[r[1]], reverse=True)
    buckets: list[list[tuple[int, int]]] = []
    for r in ordered:
        blocks = cdiv(context_lens[r[1]], page_size)
        if buckets and blocks >= slack * cdiv(context_lens[buckets[-1][0][1]], page_size):
            buckets[-1].append(r)
        elif buckets and len(buckets) >= 6:
            buckets[-1].append(r)
        else:
            buckets.append([r])
    return buckets


def _decode_batch(
    rows: list[tuple[int, int]],
    context_lens: list[int],
    block_tables: list[list[int]],
    kind: MaskKind,
    page_size: int,
    device: torch.device,
) -> DecodeBatch:
    num_blocks = max(cdiv(context_lens[i], page_size) for _, i in rows)
    tables = [block_tables[i][:num_blocks] for _, i in rows]
    ctx = int_tensor([context_lens[i] for _, i in rows], device=device)
    key_pos = torch.arange(num_blocks * page_size, device=device)
    mask = key_pos[None, :] < ctx[:, None]
    if not kind.is_full:
        first = int_tensor([kind.first_key(context_lens[i] - 1) for _, i in rows], device=device)
        mask &= key_pos[None, :] >= first[:, None]
    return DecodeBatch(
        token_index=int_tensor([t for t, _ in rows], device=device),
        query_pos=ctx - 1,
        # pages behind a window (NULL = -1) are masked: page 0 stands in for them
        page_index=padded_int_tensor(tables, num_blocks, torch.long, device).view(-1).clamp_(min=0),
        mask=mask[:, None, None, :],
        num_blocks=num_blocks,
    )


def write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: StepLayout
) -> None:
    """key/value [T, Hkv, Dk|Dv] into the pages [num_pages, P, Hkv, Dk|Dv] (a view with the pool's page stride,
    kv_cache.py) at each token's page and offset."""
    if key.shape[0] > 64:  # a prompt's K/V arrive head-major; the copy is faster from a contiguous tensor
        key, value = key.contiguous(), value.contiguous()
    pages, offsets = layout.slot_index
    k_cache.index_put_((pages, offsets), key)
    v_cache.index_put_((pages, offsets), value)


def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    call: LayerCall,
    terms: ScoreTerms | None = None,
) -> torch.Tensor:
    """q [B, Hq, n, Dk], k [B, Hkv, m, Dk], v [B, Hkv, m, Dv], mask [B or 1, 1, n, m] bool (True: seen) ->
    [B, Hq, n, Dv], computed as the models' own eager attention does: scores, soft-capping, the queries' bias,
    mask, sinks as an extra column of the softmax (then dropped). SDPA does none of these but the mask."""
    gqa = q.shape[1] // k.shape[1]
    if gqa > 1:
        k, v = k.repeat_interleave(gqa, 1), v.repeat_interleave(gqa, 1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if call.softcap is not None:
        scores = torch.tanh(scores / call.softcap) * call.softcap
    if terms is not None and terms.bias is not None:
        scores = scores + terms.bias
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = None
    if call.sinks is not None:
        sink = call.sinks.to(scores.dtype).view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    elif terms is not None and terms.sinks is not None:
        sink = terms.sinks.to(scores.dtype)
    if sink is not None:
        scores = torch.cat([scores, sink], dim=-1)
        scores = scores - scores.amax(dim=-1, keepdim=True)
        probs = scores.softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1, dtype=torch.float32)
    return torch.matmul(probs.to(v.dtype), v)


def attend(q, k, v, mask, scale: float, call: LayerCall, causal: bool = False, terms=None) -> torch.Tensor:
    """SDPA where it computes the layer (`LayerCall.plain`), else `eager_attention` (with the queries' terms)."""
    gqa = q.shape[1] > k.shape[1]
    if call.plain:
        if causal:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if causal:
        pos = torch.arange(q.shape[2], device=q.device)
        mask = FULL.visible(pos, pos)[None, None]
    return eager_attention(q, k, v, mask, scale, call, terms)


def gathered_decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    decode: list[DecodeBatch],
    scale: float,
    call: LayerCall,
    workspace: Workspace,
) -> None:
    """Decoding rows of query [T, Hq, Dk] into out [T, Hq, Dv]: each group's pages gathered into the workspace,
    then attended."""
    num_heads, head_dim = query.shape[1:]
    page_size, num_kv_heads = k_cache.shape[1:3]
    v_dim = v_cache.shape[3]
    gqa = num_heads // num_kv_heads
    for batch in decode:
        G = batch.token_index.shape[0]
        ctx = batch.num_blocks * page_size
        # GQA: the query heads of one KV head become the query rows of that head
        q = query[batch.token_index].view(G, num_kv_heads, gqa, head_dim)
        k = workspace.get("k", (G * batch.num_blocks, page_size, num_kv_heads, head_dim), k_cache)
        v = workspace.get("v", (G * batch.num_blocks, page_size, num_kv_heads, v_dim), v_cache)
        torch.index_select(k_cache, 0, batch.page_index, out=k)
        torch.index_select(v_cache, 0, batch.page_index, out=v)
        k = k.view(G, ctx, num_kv_heads, head_dim).transpose(1, 2)
        v = v.view(G, ctx, num_kv_heads, v_dim).transpose(1, 2)
        if call.plain:
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=batch.mask, scale=scale
            )  # [G, Hkv, gqa, Dv]
        else:  # the eager path wants query heads as heads: [G, Hq, 1, Dk]
            terms = call.terms(batch.token_index[:, None], batch.query_pos[:, None], ctx)
            o = eager_attention(q.reshape(G, num_heads, 1, head_dim), k, v, batch.mask, scale, call, terms)
        out[batch.token_index] = o.reshape(G, num_heads, v_dim)


def prefill_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefills: list[PrefillSequence],
    scale: float,
    call: LayerCall,
) -> None:
    """Rows of sequences computing several tokens into out, one attention call each: a whole prompt on its own
    new K/V (causal, or the mask of its kind), a later chunk or a prompt behind cached pages over its pages
    (gathered) with its mask."""
    for p in prefills:
        rows = slice(p.start, p.start + p.num_tokens)
        q = query[rows].transpose(0, 1)[None]  # [1, Hq, n, Dk]
        if p.pages is None:
            k = key[rows].transpose(0, 1)[None]
            v = value[rows].transpose(0, 1)[None]
        else:
            k = k_cache[p.pages].flatten(0, 1).transpose(0, 1)[None]  # [1, Hkv, ctx, Dk]
            v = v_cache[p.pages].flatten(0, 1).transpose(0, 1)[None]
        terms = None
        if call.token_scores is not None:
            query_pos = torch.arange(p.context_len - p.num_tokens, p.context_len, device=query.device)
            rows_index = torch.arange(p.start, p.start + p.num_tokens, device=query.device)
            terms = call.terms(rows_index[None], query_pos[None], k.shape[2])
        o = attend(q, k, v, p.mask, scale, call, causal=p.mask is None, terms=terms)
        out[rows] = o[0].transpose(0, 1)


# ---- the function transformers calls ----------------------------------------------------------------------------
# Keyword arguments that do not change what attention computes here: positions are already in q/k (RoPE), the
# rest steer caching or outputs that batchrun does not use.
NEUTRAL_KWARGS = frozenset(
    {"position_ids", "cache_position", "use_cache", "output_attentions", "output_router_logits"}
)


@dataclass
class AttentionServices:
    """The engine's parts every layer's call reaches, made once per engine: the backend, the pages (and in
    them each layer's KV cache group), the clock, and what the load probe learned of each layer
    (architecture.ModelLayers)."""

    backend: Any  # TorchAttention | GatherAttention | TritonAttention | architecture.ProbeAttention
    kv_cache: Any  # kv_cache.KVCache (None for the load probe)
    times: Any  # timing.PhaseTimes: the layers add their seconds to "attention"
    layers: Any  # architecture.ModelLayers: chunk size and query-scale fix of each layer


class AttentionMetadata:
    """One step's inputs to the layers, shared by every layer: a layout per KV cache group, the backend's plan
    for each group, built by the group's first layer and reused by the others, and a hybrid model's state slots
    (`states`: state_cache.StepStates, or the load probe's StateProbe; None for a model without stateful
    layers)."""

    def __init__(
        self, services: AttentionServices, layouts: list[StepLayout], positions: list[int], states: Any = None
    ):
        self.services = services
        self.layouts = layouts  # per KV cache group
        self.positions = positions  # [T] each packed token's position in its sequence
        self.states = states
        self._plans: dict[tuple[int, MaskKind], Any] = {}
        self._query_scales: dict[Any, torch.Tensor] = {}
        self._shared_calls: dict[int, int] = {}  # id(shared module) -> its calls so far this step

    def layer_index(self, module: torch.nn.Module) -> int:
        """The layer an attention call is: the module's `layer_idx`, or for a module shared by several layers
        (none of its own), its call's place among this forward's calls of it (ModelLayers.shared_layer)."""
        layer = getattr(module, "layer_idx", None)
        if isinstance(layer, int) and layer >= 0:
            return layer
        if self.services.layers is None:
            raise UnsupportedModel(f"{type(module).__name__} has no layer index (layer_idx={layer!r})")
        k = self._shared_calls.get(id(module), 0)
        self._shared_calls[id(module)] = k + 1
        return self.services.layers.shared_layer(module, k)

    @contextlib.contextmanager
    def running(self):
        """This step's metadata for the stateful modules called inside (architecture._stateful_forward): they
        read it here, since some models do not pass their keyword arguments on to them (Jamba's decoder layer
        calls its Mamba mixer with its hidden states and cache alone). The attention layers get it from the
        keyword arguments transformers passes them."""
        token = _RUNNING.set(self)
        try:
            yield self
        finally:
            _RUNNING.reset(token)

    @staticmethod
    def current() -> AttentionMetadata | None:
        """The metadata of the step being run (`running`), or None outside one."""
        return _RUNNING.get()

    def layer(self, layer: int):
        """A layer's place in the pages (kv_cache.LayerPages: its group, K and V views, whether it writes)."""
        return self.services.kv_cache.layer(layer)

    def plan(self, group: int, kind: MaskKind):
        """The backend's plan for a group's layers of a mask kind, made by the first of them."""
        key = (group, kind)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self.services.backend.prepare(self.layouts[group], kind, group)
        return plan

    def query_scale_fix(self, fix, like: torch.Tensor) -> torch.Tensor:
        """[T, 1, 1]: the factor that turns the query scale a layer derived from packed-row indices into the
        one of each token's true position (architecture.QueryScaleFix)."""
        t = self._query_scales.get(fix)
        if t is None:
            t = self._query_scales[fix] = fix.factor(self.positions).to(like.device, like.dtype)[
                :, None, None
            ]
        return t


_RUNNING: ContextVar[AttentionMetadata | None] = ContextVar("batchrun_step", default=None)


def layer_call(
    module: torch.nn.Module, layer: int, attention_mask, dropout: float, kwargs: dict, layers, query_shape
) -> LayerCall:
    """The layer's call checked and read: every argument is honoured or known not to matter, else
    UnsupportedModel naming it. `query_shape`: [1, Hq, T, D]."""
    where = f"{type(module).__name__} (layer {layer})"
    if attention_mask is not None:
        raise UnsupportedModel(
            f"{where} passes an attention mask of its own; batchrun builds each sequence's mask itself and "
            "cannot honour another"
        )
    if dropout:
        raise UnsupportedModel(
            f"{where} asks for attention dropout {dropout} (the model is not in eval mode?)"
        )
    if kwargs.get("is_causal", True) is False:
        raise UnsupportedModel(f"{where} asks for non-causal attention; batchrun runs causal language models")
    token_scores = _token_scores(where, kwargs, query_shape)
    for name, value in kwargs.items():
        if name in NEUTRAL_KWARGS or name in ("sliding_window", "softcap", "s_aux", "is_causal"):
            continue
        if token_scores is not None and name in ("position_bias", "sinks"):
            continue
        if value is None or value is False:
            continue
        raise UnsupportedModel(
            f"{where} passes the attention argument `{name}`, which batchrun's paged attention does not "
            "implement; it is refused rather than ignored"
        )
    window = kwargs.get("sliding_window")
    chunk = layers.chunk(layer) if layers is not None else None
    if window is not None and chunk is not None:
        raise UnsupportedModel(f"{where} asks for both a sliding window and chunked attention")
    sinks = kwargs.get("s_aux")
    kind = MaskKind(int(window) if window else None, chunk)
    return LayerCall(kind, kwargs.get("softcap") or None, sinks, token_scores)


def _token_scores(where: str, kwargs: dict, query_shape) -> TokenScores | None:
    """Inkling 2's per-token terms: `sinks` [1, Hq, T, 1] (a logit per query token and head, from its hidden
    state) and `position_bias` as batchrun's adapter of its bias module gives it (RelativeBias). A bias tensor
    of another form is over the packed row's indices, not the tokens' positions: not taken."""
    bias, sinks = kwargs.get("position_bias"), kwargs.get("sinks")
    if bias is None and sinks is None:
        return None
    _, num_heads, num_tokens, _ = query_shape
    if bias is not None and not isinstance(bias, RelativeBias):
        raise UnsupportedModel(
            f"{where} passes a `position_bias` of its own ({type(bias).__name__}), made over the packed row "
            "rather than each sequence's positions; batchrun takes only a relative bias module it knows "
            "(architecture.RELATIVE_BIAS)"
        )
    if sinks is not None and tuple(sinks.shape) != (1, num_heads, num_tokens, 1):
        raise UnsupportedModel(
            f"{where} passes `sinks` of shape {tuple(sinks.shape)}, not one logit per head and query token"
        )
    return TokenScores(
        relative_bias=None if bias is None else bias.logits[0].transpose(0, 1),  # [T, Hq, R]
        sinks=None if sinks is None else sinks[0, :, :, 0].transpose(0, 1),  # [T, Hq]
    )


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function `transformers` calls for every attention layer; returns [1, T, Hq, Dv]. A module that
    attends over something other than the sequence's tokens runs its model's own eager attention
    (architecture.OWN_ATTENTION marks it at load)."""
    own = getattr(module, "_batchrun_own_attention", None)
    if own is not None:
        return own(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    meta: AttentionMetadata | None = kwargs.pop("batchrun_attn", None)
    if meta is None:
        raise UnsupportedModel(
            f"{type(module).__name__}: its attention does not pass batchrun's step metadata (the model's code "
            "calls the attention function without the keyword arguments it was given)"
        )
    services = meta.services
    layer = meta.layer_index(module)
    call = layer_call(module, layer, attention_mask, dropout, kwargs, services.layers, query.shape)
    assert query.shape[0] == 1, "batchrun packs every sequence into one row"
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q = query[0].transpose(0, 1)  # [T, Hq, Dk]
    k = key[0].transpose(0, 1)  # [T, Hkv, Dk]
    v = value[0].transpose(0, 1)  # [T, Hkv, Dv]
    fix = services.layers.query_scale_fix(layer) if services.layers is not None else None
    if fix is not None:
        q = q * meta.query_scale_fix(fix, q)
    t0 = time.perf_counter()
    out = services.backend.forward(meta, layer, call, q, k, v, scale)
    if services.times is not None:
        services.times.add("attention", time.perf_counter() - t0)
    return out[None], None


# ---- backends ---------------------------------------------------------------------------------------------------
@dataclass
class GatherPlan:
    decode: list[DecodeBatch]
    prefills: list[PrefillSequence]


class GatherAttention:
    """Pages gathered into a reused workspace per decode group, then SDPA; prompts attend on their own K/V."""

    name = "gather"

    def __init__(self, page_size: int, device: torch.device):
        self.page_size = page_size
        self.device = device
        self.workspace = Workspace()

    def prepare(self, layout: StepLayout, kind: MaskKind, group: int) -> GatherPlan:
        """Decodes batched in groups of similar context length (padded, masked)."""
        rows, prefills = split_step(layout, kind, self.page_size, self.device)
        ctx, tables, P = layout.context_lens, layout.block_tables, self.page_size
        buckets = _buckets_by_length(rows, ctx, P)
        return GatherPlan([_decode_batch(b, ctx, tables, kind, P, self.device) for b in buckets], prefills)

    def forward(self, meta: AttentionMetadata, layer: int, call: LayerCall, q, k, v, scale: float):
        group, k_cache, v_cache, writes = meta.layer(layer)
        if writes:
            write_kv(k, v, k_cache, v_cache, meta.layouts[group])
        plan: GatherPlan = meta.plan(group, call.kind)
        out = q.new_empty(*q.shape[:2], v.shape[-1])
        gathered_decode_attention(out, q, k_cache, v_cache, plan.decode, scale, call, self.workspace)
        prefill_attention(out, q, k, v, k_cache, v_cache, plan.prefills, scale, call)
        return out


@dataclass
class PagedDecode:
    """The step's decoding sequences, for the C++ kernel that reads their pages in place."""

    token_index: torch.Tensor  # [G] int64: packed row of each one's query
    block_tables: torch.Tensor  # [G, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [G] int32: context, the new token included
    first_keys: torch.Tensor | None  # [G] int32: the first key each one sees (window, chunk); None: 0
    num_keys_read: int  # keys the kernel reads per layer and KV head (from each first visible key's page)


@dataclass
class TorchPlan:
    decode: PagedDecode | None
    prefills: list[PrefillSequence]


class TorchAttention:
    """Decoding sequences through the C++ paged-decode kernel (no copy of their pages); every other sequence
    through SDPA, as in GatherAttention."""

    name = "torch"

    def __init__(self, page_size: int, kernel):
        self.page_size = page_size
        self.kernel = kernel  # cpu_kernels.load(): the compiled module
        self.device = torch.device("cpu")

    def prepare(self, layout: StepLayout, kind: MaskKind, group: int) -> TorchPlan:
        rows, prefills = split_step(layout, kind, self.page_size, self.device)
        if not rows:
            return TorchPlan(None, prefills)
        tables = [layout.block_tables[i] for _, i in rows]
        width = max(len(t) for t in tables)
        ctx = [layout.context_lens[i] for _, i in rows]
        first = [kind.first_key(c - 1) for c in ctx]
        P = self.page_size
        decode = PagedDecode(
            token_index=int_tensor([start for start, _ in rows]),
            block_tables=padded_int_tensor(tables, width, torch.int32),
            seq_lens=int_tensor(ctx, torch.int32),
            first_keys=None if kind.is_full else int_tensor(first, torch.int32),
            num_keys_read=sum(c - f // P * P for c, f in zip(ctx, first)),
        )
        return TorchPlan(decode, prefills)

    def forward(self, meta: AttentionMetadata, layer: int, call: LayerCall, q, k, v, scale: float):
        times = meta.services.times  # its parts, for bench/micro/profile_step.py attention
        group, k_cache, v_cache, writes = meta.layer(layer)
        plan: TorchPlan = meta.plan(group, call.kind)
        if writes:
            with times.part(
                "write K/V, steps with prompts" if plan.prefills else "write K/V, decode-only steps"
            ):
                write_kv(k, v, k_cache, v_cache, meta.layouts[group])
        out = q.new_empty(*q.shape[:2], v.shape[-1])
        if plan.decode is not None:
            d = plan.decode
            sinks, bias = call.sink_logits, call.relative_bias
            sinks = None if sinks is None else sinks.detach().float().contiguous()
            bias = None if bias is None else bias.detach().float()
            with times.part("C++ decode"):
                self.kernel.paged_decode_attention(
                    out, q, k_cache, v_cache, d.block_tables, d.seq_lens, d.token_index, scale,
                    d.first_keys, call.softcap or 0.0, sinks, bias,
                )  # fmt: skip
            times.count(
                "C++ decode: K/V bytes read", d.num_keys_read * (k_cache[0, 0].nbytes + v_cache[0, 0].nbytes)
            )
        if plan.prefills:
            with times.part("prompts' attention"):
                prefill_attention(out, q, k, v, k_cache, v_cache, plan.prefills, scale, call)
        return out


@dataclass
class TritonPlan:
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    query_start_loc: torch.Tensor  # [S + 1] int32: packed offsets of each sequence's query tokens
    seq_lens: torch.Tensor  # [S] int32
    query_blocks: Any  # batchrun_kernels.QueryBlocks: the grid mapping


class TritonAttention:
    """The paged Triton kernels: K/V written and read in place; the grid mapping built once per step and KV
    cache group (the mask kind is a run-time argument of the kernel; a group's query heads per KV head, of its
    layers' shape, set the grid)."""

    name = "triton"

    def __init__(self, gqa: tuple[int, ...], device: torch.device):
        import batchrun_kernels

        self.kernels = batchrun_kernels
        self.gqa = gqa  # per KV cache group
        self.device = device

    def prepare(self, layout: StepLayout, kind: MaskKind, group: int) -> TritonPlan:
        dev = self.device
        max_blocks = max(len(t) for t in layout.block_tables)
        query_start = [0]
        for n in layout.query_lens:
            query_start.append(query_start[-1] + n)
        return TritonPlan(
            block_tables=padded_int_tensor(layout.block_tables, max_blocks, torch.int32, dev),
            query_start_loc=int_tensor(query_start, torch.int32, dev),
            seq_lens=int_tensor(layout.context_lens, torch.int32, dev),
            query_blocks=self.kernels.plan_query_blocks(layout.query_lens, self.gqa[group], dev),
        )

    def forward(self, meta: AttentionMetadata, layer: int, call: LayerCall, q, k, v, scale: float):
        group, k_cache, v_cache, writes = meta.layer(layer)
        plan: TritonPlan = meta.plan(group, call.kind)
        if writes:
            self.kernels.write_kv_cache(k, v, k_cache, v_cache, meta.layouts[group].slot_mapping)
        return self.kernels.paged_attention(
            q.contiguous(),
            k_cache,
            v_cache,
            plan.block_tables,
            plan.query_start_loc,
            plan.seq_lens,
            scale,
            plan.query_blocks,
            window=call.kind.window or 0,
            chunk=call.kind.chunk or 0,
            softcap=call.softcap or 0.0,
            sinks=call.sink_logits,
            relative_bias=call.relative_bias,
        )


def make_backend(name: str, num_heads: int, kv_spec: Any, device: torch.device):
    """The attention backend for `engine.attention`, chosen once: auto is triton on CUDA, torch elsewhere; torch
    is the C++ paged decode on the CPU, gather where that cannot be built or on another device. `kv_spec`: the
    kv_cache.KVCacheSpec (page size, dtype, each group's KV heads and head dims). A shape the Triton kernels do
    not take is a bad job here, at load, not an error in every row."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    page_size, shapes = kv_spec.page_size, kv_spec.groups.shapes
    if name == "triton":
        import batchrun_kernels

        gqa = tuple(num_heads // s.num_kv_heads for s in shapes)
        for shape, g in zip(shapes, gqa):
            why = batchrun_kernels.unsupported_reason(
                kv_spec.dtype, page_size, shape.head_dim, shape.v_head_dim, g
            )
            if why:
                raise BadInput(
                    f"key `engine.attention`: triton cannot run this model: {why}; use attention: gather"
                )
        return TritonAttention(gqa, device)
    if name == "torch" and device.type == "cpu":
        from . import cpu_kernels

        kernel = cpu_kernels.load()
        if kernel is not None:
            return TorchAttention(page_size, kernel)
    return GatherAttention(page_size, device)


def register() -> None:
    """Make `attn_implementation="batchrun_paged"` known to transformers (idempotent, no global patching)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
