"""Two operations of a packed embedding step on the CPU, in one thread, timed in that thread's CPU time (best of
5; bench/RESULTS.md, issue 41): the attention (SDPA) of a text of 256 tokens, per text, alone on a [1, H, L, D]
slice of the packed row and 16 texts of its length side by side on a view of it (what packed_attention.py does),
alone on a 3-D [H, L, D] slice (SDPA's slower path), and 16 texts with a mask (what padded groups cost); and a
MiniLM-sized linear layer on a 4096-token row (stock `nn.Linear` against its weights packed for oneDNN, what the
pooling runner does on the CPU).

Usage: python -m bench.micro.embed_ops
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from batchrun.engine.model.ops.cpu_linear import PackedLinear

from ..common import best_seconds as best


def main() -> None:
    torch.set_num_threads(1)
    heads, length, dim, texts = 12, 256, 32, 16
    row = torch.randn(1, texts * length, heads, dim).transpose(1, 2)  # [1, H, T, D], as transformers gives it
    one = row[:, :, :length]
    batch = row[0].unflatten(1, (texts, length)).transpose(0, 1)  # [16, H, L, D]: a view, no copy
    mask = torch.ones(texts, 1, length, length, dtype=torch.bool)

    def attend(*qkv, **kw):
        return F.scaled_dot_product_attention(*qkv, **kw)

    def best_seconds(fn):
        return best(fn, clock=time.thread_time)

    with torch.inference_mode():
        sdpa = {
            "alone, 4-D": best_seconds(lambda: attend(one, one, one)),
            "alone, 3-D": best_seconds(lambda: attend(one[0], one[0], one[0])),
            "16 side by side": best_seconds(lambda: attend(batch, batch, batch)) / texts,
            "16 with a mask": best_seconds(lambda: attend(batch, batch, batch, attn_mask=mask)) / texts,
        }
        x = torch.randn(1, 4096, 384)
        linear = torch.nn.Linear(384, 1536)
        packed = PackedLinear(linear)
        stock_s, packed_s = best_seconds(lambda: linear(x)), best_seconds(lambda: packed(x))
    each = ", ".join(f"{name} {s * 1e3:.2f}" for name, s in sdpa.items())
    print(f"SDPA of one text of {length} tokens ({heads} heads of {dim}), ms per text, one thread: {each}")
    print(
        f"linear [4096, 384] x [384, 1536]: nn.Linear {stock_s * 1e3:.1f} ms, packed {packed_s * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
