"""A bf16 pooling step's packed attention by the C++ prompt kernel (attention/packed.py, cpu_prompt_attention.cpp
with `causal` false for an encoder): the texts of at least the kernel's key block through the kernel, the
shorter ones through SDPA, each text attending to itself alone under its layer's mask, against plain softmax
attention over that text alone in fp32 (the bf16 tolerance of tests/test_cpu_prompt_attention.py); a window
leaves the whole row on SDPA."""

from __future__ import annotations

import pytest
import torch

from batchrun.engine.attention import METADATA_KEYWORD, PackedLayout
from batchrun.engine.attention.interface import attention_forward
from batchrun.engine.cpu_kernels import load

KERNEL = load()
pytestmark = pytest.mark.skipif(
    KERNEL is None or not KERNEL.prompt_attention_bf16_supported(32, 32, 1),
    reason="no AVX512-BF16 prompt kernel",
)
LENGTHS = [70, 5, 130, 70, 20, 64, 1]  # three runs for the kernel (130, 70 twice, 64), three for SDPA
# the kernel's key block (cpu_prompt_attention.cpp's kKeys, `prompt_attention_key_block`): a text of fewer tokens
# stays on SDPA. Written out here, so LENGTHS put a text exactly on it (64) and one either side; checked below
BLOCK = 64


class Counting:
    """The kernel module, recording the query tokens each call of its prompt attention computes."""

    def __init__(self, kernel):
        self.kernel, self.rows = kernel, []

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def paged_prompt_attention(self, out, q, k_pages, v_pages, tables, starts, lengths, *args, **kwargs):
        self.rows.append(int(lengths.sum()))
        args = (k_pages, v_pages, tables, starts, lengths, *args)
        return self.kernel.paged_prompt_attention(out, q, *args, **kwargs)


def reference(q, k, v, a, b, causal, window, scale):
    """Text [a, b)'s output [L, Hq, D] by plain softmax attention over it alone, in fp32 (GQA: 2 query heads per
    KV head)."""
    q, k, v = (x[0, :, a:b].float() for x in (q, k, v))
    k, v = (x.repeat_interleave(q.shape[0] // x.shape[0], dim=0) for x in (k, v))
    back = torch.arange(b - a)[:, None] - torch.arange(b - a)[None, :]
    seen = (back >= 0) if causal else torch.ones_like(back, dtype=torch.bool)
    if window is not None:
        seen &= back.abs() < window
    scores = (q @ k.transpose(1, 2) * scale).masked_fill(~seen, float("-inf"))
    return (scores.softmax(dim=-1) @ v).transpose(0, 1)


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (False, 50)])
def test_a_bf16_packed_call_is_each_text_alone(causal, window):
    torch.manual_seed(0)
    kernel = Counting(KERNEL)
    layout = PackedLayout.of_lengths(LENGTHS, kernel=kernel)
    T, D = sum(LENGTHS), 32
    q, k, v = (torch.randn(1, h, T, D).to(torch.bfloat16) for h in (4, 2, 2))
    module = torch.nn.Module()
    module.is_causal = causal
    out, _ = attention_forward(
        module, q, k, v, None, scaling=0.2, sliding_window=window, **{METADATA_KEYWORD: layout}
    )
    assert out.shape == (1, T, 4, D) and out.dtype == torch.bfloat16
    assert KERNEL.prompt_attention_key_block == BLOCK  # LENGTHS' edges are the kernel's
    tables, starts, lengths, end = layout.kernel_texts()
    assert sorted(lengths.tolist()) == sorted(n for n in LENGTHS if n >= BLOCK)
    long = sum(n for n in LENGTHS if n >= BLOCK)
    # the long texts' rows by the kernel, once; a windowed layer's whole row by SDPA
    assert kernel.rows == ([] if window is not None else [long])
    for a, b in layout.spans():
        want = reference(q, k, v, a, b, causal, window, 0.2)
        err = (out[0, a:b].float() - want).norm() / want.norm()
        assert err.item() < 1e-2, (b - a, err)
        assert (out[0, a:b].float() - want).abs().max().item() < 3e-2


def test_the_kernel_and_sdpa_agree_on_a_long_text():
    """The same text of 100 tokens through the kernel and through SDPA (no kernel chosen): within bf16 rounding."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 4, 100, 32).to(torch.bfloat16) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = False
    outs = [
        attention_forward(
            module,
            q,
            k,
            v,
            None,
            scaling=None,
            **{METADATA_KEYWORD: PackedLayout.of_lengths([100], kernel=kernel)},
        )[0].float()
        for kernel in (KERNEL, None)
    ]
    assert ((outs[0] - outs[1]).norm() / outs[1].norm()).item() < 1e-2
    assert not torch.equal(outs[0], outs[1])  # two computations (the kernel was called), not one


def test_rows_keys_or_pages_out_of_range_are_errors_not_reads():
    """The kernel checks every row, key and page a sequence names against its tensors before reading any."""
    q = torch.randn(8, 4, 32).to(torch.bfloat16)
    k, v = (torch.randn(3, 4, 2, 32).to(torch.bfloat16) for _ in range(2))  # 3 pages of 4 tokens

    def call(table, start=0, qlen=8, ctx=8):
        tables, starts, qlens, ctxs = (
            torch.tensor(x, dtype=torch.int32) for x in ([table], [start], [qlen], [ctx])
        )
        out = torch.empty_like(q)
        KERNEL.paged_prompt_attention(out, q, k, v, tables, starts, qlens, ctxs, 0.2, 0, 0, 0.0, None, True)
        return out

    assert call([0, 1]).isfinite().all()  # in range: computed
    for bad in (dict(table=[0, 3]), dict(table=[0, -1]), dict(start=1), dict(qlen=8, ctx=7), dict(ctx=12)):
        with pytest.raises(RuntimeError, match="out of range|names page"):
            call(**{"table": [0, 1], **bad})


@pytest.mark.parametrize("gqa, by_kernel", [(16, True), (17, False)])
def test_query_heads_per_kv_head_beyond_the_kernels_stay_on_sdpa(gqa, by_kernel):
    """The kernel's bound on query heads per KV head (a tile's rows) is its own answer: up to 16 through it, more
    through SDPA, each against plain attention."""
    torch.manual_seed(2)
    kernel = Counting(KERNEL)
    q = torch.randn(1, gqa, 70, 32).to(torch.bfloat16)
    k, v = (torch.randn(1, 1, 70, 32).to(torch.bfloat16) for _ in range(2))
    module = torch.nn.Module()
    module.is_causal = False
    layout = PackedLayout.of_lengths([70], kernel=kernel)
    out, _ = attention_forward(module, q, k, v, None, scaling=0.2, **{METADATA_KEYWORD: layout})
    assert kernel.rows == ([70] if by_kernel else [])
    want = reference(q, k, v, 0, 70, False, None, 0.2)
    assert ((out[0].float() - want).norm() / want.norm()).item() < 1e-2
