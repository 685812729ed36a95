"""Two operations of a packed embedding step, timed on the CPU (bench/RESULTS.md, issue 41): gathering a group
of texts' queries out of the packed row (advanced indexing against `index_select`, what packed_attention.py
uses), and a MiniLM-sized linear layer on a 4096-token row (stock `nn.Linear` against its weights packed for
oneDNN, what the pooling runner does on the CPU).

Usage: python -m bench.micro.embed_ops
"""

from __future__ import annotations

import torch

from batchrun.engine.cpu_linear import PackedLinear

from ..common import best_seconds


def main() -> None:
    heads, tokens, dim, texts = 12, 4096, 32, 16
    row = torch.randn(heads, tokens, dim)
    index = torch.arange(tokens).view(texts, tokens // texts)
    flat = index.flatten()
    with torch.inference_mode():
        fancy = best_seconds(lambda: row[:, index])
        select = best_seconds(lambda: row.index_select(1, flat).view(heads, texts, -1, dim))
        x = torch.randn(1, tokens, 384)
        linear = torch.nn.Linear(384, 1536)
        packed = PackedLinear(linear)
        stock_s, packed_s = best_seconds(lambda: linear(x)), best_seconds(lambda: packed(x))
    print(f"gather [{heads}, {tokens}, {dim}] into {texts} texts: advanced indexing {fancy * 1e3:.2f} ms, "
          f"index_select {select * 1e3:.2f} ms")  # fmt: skip
    print(
        f"linear [{tokens}, 384] x [384, 1536]: nn.Linear {stock_s * 1e3:.1f} ms, packed {packed_s * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
