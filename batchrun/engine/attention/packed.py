"""The packed layout of a pooling step, and its attention: the ENCODER_ONLY path beside the paged one (after
vLLM v1, where an encoder-only model runs through the same attention layer with no KV cache).

A pooling job keeps no K/V after a text is pooled, so there are no pages: the step's texts are packed into one
row of tokens with no padding, each text attending only to itself. `transformers` calls the one attention function
(interface.py) with q [1, Hq, T, D] and k/v [1, Hkv, T, D] of the whole packed row and the step's `PackedLayout`
(built once before the forward) as the `batchrun_attn` keyword, where the paged path gets its `AttentionMetadata`;
the call is read and checked as every call is (interface.read_call), then attends here. The layout chooses the
packing order: the texts longest first, so that texts of one length sit side by side and attend in one SDPA call
on a view of the row ([n, H, L, D], no gather, no padding, no mask for full attention, `is_causal` for a
decoder's); a text of a length of its own attends on its slice. The runner packs the texts in that order and
reads each text's states back through `spans` (input order), so the order never shows outside. Which keys a
query sees is the layer's `MaskKind` (masks.py): bidirectional for an encoder (BERT, XLM-R, ModernBERT), causal
for a decoder (Qwen3-Embedding), a sliding window (ModernBERT's local layers) on both sides for an encoder.

A bf16 step on a CPU with AVX512-BF16 attends its texts of at least one key block of the kernel
(`prompt_attention_key_block`) in one call of batchrun's C++ prompt kernel (engine/csrc/cpu_prompt_attention.cpp,
generation's, `causal` as the layer's kind says) instead, where SDPA gains nothing from bf16: the kernel reads K/V
as pages, and the packed row is given to it as pages of one token each (a text's block table: its rows), so
nothing is copied. Shorter texts stay on SDPA: the kernel computes keys a whole block at a time, and a shorter text
pays for the whole block (a step with and without the kernel: bench/micro/embed_profile.py --compare). Full
attention only (no window or chunk: ModernBERT's local layers stay on SDPA). Which shapes the kernel takes (head
dims, query heads per KV head: `prompt_attention_bf16_supported`) and its key block are the kernel module's own
answers, asked here as the generation backend asks them (attention/backends/prompt_kernel.py), never restated.

Why not pad texts of near lengths into one call: on the CPU, SDPA costs the same per text in a batch of one as in
a batch of sixteen (bench/RESULTS.md, issue 41), while padding adds gathers, scatters, masks (a masked call is
slower) and the padding's own arithmetic. On a GPU each run is a kernel launch of its own (a step of texts of many
lengths makes one per length and layer); a variable-length kernel taking the whole row at once would remove them,
and is not written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from batchrun.engine.attention.layers import LayerSpec
from batchrun.engine.attention.masks import MaskKind
from batchrun.engine.attention.metadata import int_tensor


@dataclass(frozen=True)
class AttentionRun:
    """`count` texts of `length` tokens each, side by side in the packed row from `start`: one SDPA call."""

    start: int
    count: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.count * self.length


@dataclass
class PackedLayout:
    """A step's packed row, built once before the forward: `order` the texts in packing order (indices into the
    step's texts), `starts[i]` where text i begins in the row, `lengths[i]` its tokens, `runs` how the row
    attends; `calls`: the layers that attended through it so far (a refusal names the layer by it); `specs`:
    each layer's call as the pooling load's probe read it (None: this is the probe's forward, which reads every
    call in full and records it in `probed`, for the runner to freeze); `kernel`: batchrun's C++ kernels where
    the runner chose the bf16 prompt kernel (None: SDPA only)."""

    order: tuple[int, ...]
    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    runs: list[AttentionRun]
    calls: int = 0
    masks: dict = field(default_factory=dict)  # (length, MaskKind) -> [L, L] bool, made once per step
    specs: tuple[LayerSpec, ...] | None = None
    probed: list[LayerSpec] = field(default_factory=list)
    kernel: Any = None
    _kernel_texts: tuple | None = None  # (block tables, starts, lengths) of the kernel's texts, made once

    @classmethod
    def of_lengths(
        cls, lengths: list[int], specs: tuple[LayerSpec, ...] | None = None, kernel: Any = None
    ) -> PackedLayout:
        """The texts longest first (ties in their given order), each run of one length attending together;
        `specs`: the layers' frozen calls (None: the load's probe); `kernel`: as the field."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        starts, runs, at = [0] * len(lengths), [], 0
        for i in order:
            n = lengths[i]
            starts[i] = at
            last = runs[-1] if runs else None
            if last is not None and last.length == n:
                runs[-1] = AttentionRun(last.start, last.count + 1, n)
            else:
                runs.append(AttentionRun(at, 1, n))
            at += n
        return cls(tuple(order), tuple(starts), tuple(lengths), runs, specs=specs, kernel=kernel)

    def packed(self, per_text: list[list]) -> list:
        """A per-text list (token ids, positions, segments) flattened in packing order."""
        return [x for i in self.order for x in per_text[i]]

    def spans(self):
        """Each text's (start, end) in the row, in the step's order of texts."""
        return ((a, a + n) for a, n in zip(self.starts, self.lengths))

    def mask(self, length: int, kind: MaskKind, device) -> torch.Tensor | None:
        """The [L, L] mask of a text of `length` under `kind`; None where `is_causal` or no mask says it (no
        window, or one at least as long as the text)."""
        if kind.window is None or kind.window >= length:
            return None
        key = (length, kind)
        if key not in self.masks:
            pos = torch.arange(length, device=device)
            self.masks[key] = kind.visible(pos, pos)
        return self.masks[key]

    def kernel_texts(self) -> tuple:
        """The block tables [S, L] (each text's rows of the packed row, a page of one token each), starts and
        lengths [S] int32 of the texts the prompt kernel attends (the longest runs: the row's head), and where
        their rows end; made at the first layer, kept for the others."""
        if self._kernel_texts is None:
            shortest = self.kernel.prompt_attention_key_block  # a text shorter than a key block stays on SDPA
            runs = [r for r in self.runs if r.length >= shortest]
            starts = [r.start + i * r.length for r in runs for i in range(r.count)]
            lengths = [r.length for r in runs for _ in range(r.count)]
            longest = lengths[0] if lengths else 0
            tables = int_tensor(starts, torch.int32)[:, None] + torch.arange(longest, dtype=torch.int32)
            end = runs[-1].end if runs else 0
            self._kernel_texts = (
                tables,
                int_tensor(starts, torch.int32),
                int_tensor(lengths, torch.int32),
                end,
            )
        return self._kernel_texts


def attend_packed(
    layout: PackedLayout, kind: MaskKind, query, key, value, scale: float | None
) -> torch.Tensor:
    """One layer's attention over the packed row, one SDPA call per run of texts of one length; returns
    [1, T, Hq, D] (the layout transformers expects), contiguous, so that the model's reshape to [1, T, Hq * D]
    copies nothing. The call was checked by interface.packed_forward (plain: no soft-capping, sinks or
    per-token terms; no chunk)."""
    layout.calls += 1
    gqa = query.shape[1] != key.shape[1]
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [T, Hq, D]
    q, k, v = query[0], key[0], value[0]  # [H, T, D]
    done = attend_by_kernel(layout, kind, out, q, k, v, scale)  # the row's first `done` tokens
    for run in layout.runs:
        if run.start < done:
            continue
        n, length = run.count, run.length
        mask = layout.mask(length, kind, query.device)
        # [n, H, L, D]: views of the row, as the run's texts sit side by side in it
        texts = [x[:, run.start : run.end].unflatten(1, (n, length)).transpose(0, 1) for x in (q, k, v)]
        o = F.scaled_dot_product_attention(
            *texts, attn_mask=mask, is_causal=kind.causal and mask is None, scale=scale, enable_gqa=gqa
        )
        out[run.start : run.end].unflatten(0, (n, length)).copy_(o.transpose(1, 2))
    return out[None]


def attend_by_kernel(layout: PackedLayout, kind: MaskKind, out, q, k, v, scale: float | None) -> int:
    """The texts the prompt kernel takes, attended into `out` [T, Hq, D]; returns where their rows end (0: none
    taken: no kernel chosen, another dtype, a window or chunk, a head dim or GQA the build does not take)."""
    kernel = layout.kernel
    if (
        kernel is None
        or q.dtype != torch.bfloat16
        or not kind.is_full
        or not kernel.prompt_attention_bf16_supported(q.shape[-1], v.shape[-1], q.shape[0] // k.shape[0])
    ):
        return 0
    tables, starts, lengths, end = layout.kernel_texts()
    if not end:
        return 0
    pages = [x.transpose(0, 1)[:, None] for x in (k, v)]  # [T, 1, Hkv, D]: a page per token, a view
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kernel.paged_prompt_attention(
        out, q.transpose(0, 1), *pages, tables, starts, lengths, lengths, scale, causal=kind.causal
    )
    return end
