"""Decode attention on the CPU, three ways, on the shape of a reference-workload decode step (SmolLM2-135M's
heads: 9 query heads, 3 KV heads, head dim 64; 16-token pages in shuffled order), per layer:

1. gather + SDPA: each group of similar context length copies its pages into a workspace, then one padded,
   masked SDPA (batchrun's `attention: gather`);
2. SDPA per sequence: each sequence's pages indexed out (a copy), one unpadded SDPA each;
3. C++ paged decode: one call reads every sequence's K/V in the pages (batchrun's `attention: torch` on the CPU).

Each is checked against the plain PyTorch reference first. Usage: python -m bench.micro.attention_cpu [--seqs 60]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from batchrun_kernels import ref_paged_attention

from batchrun.engine.attention import (
    FULL,
    GatherAttention,
    LayerCall,
    StepLayout,
    TorchAttention,
    gathered_decode_attention,
)
from batchrun.engine.cpu_kernels import load

from ..common import best_seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=60)
    ap.add_argument("--min-ctx", type=int, default=100)
    ap.add_argument("--max-ctx", type=int, default=500)
    args = ap.parse_args()
    P = 16
    gen = torch.Generator().manual_seed(0)
    ctxs = torch.randint(args.min_ctx, args.max_ctx, (args.seqs,), generator=gen).tolist()
    blocks = [-(-c // P) for c in ctxs]
    order = torch.randperm(sum(blocks) + 8, generator=gen).tolist()
    tables, i = [], 0
    for b in blocks:
        tables.append(order[i : i + b])
        i += b
    layout = StepLayout([1] * args.seqs, ctxs, tables, torch.zeros(args.seqs, dtype=torch.long))
    kernel = load()
    print(
        f"{args.seqs} decoding sequences, contexts {min(ctxs)}-{max(ctxs)}, {torch.get_num_threads()} threads"
    )
    print("| dtype | gather + SDPA ms | SDPA per sequence ms | C++ paged decode ms | C++ speed-up |")
    print("|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        times = measure(dtype, layout, ctxs, tables, kernel, gen)
        name = str(dtype).replace("torch.", "")
        print(
            f"| {name} | {times[0] * 1e3:.2f} | {times[1] * 1e3:.2f} | {times[2] * 1e3:.2f} | "
            f"{times[0] / times[2]:.2f}x |"
        )


def measure(dtype, layout: StepLayout, ctxs: list[int], tables: list[list[int]], kernel, gen) -> list[float]:
    """Best-of-20 seconds of each way, after checking its output against the reference."""
    Hkv, gqa, D, P = 3, 3, 64, 16  # SmolLM2-135M's heads, 16-token pages
    G = len(ctxs)
    num_pages = max(max(t) for t in tables) + 1
    scale = D**-0.5
    kc = torch.randn(num_pages, P, Hkv, D, generator=gen).to(dtype)
    vc = torch.randn(num_pages, P, Hkv, D, generator=gen).to(dtype)
    q = torch.randn(G, Hkv * gqa, D, generator=gen).to(dtype)
    out = torch.empty_like(q)
    torch_backend = GatherAttention(P, torch.device("cpu"))
    plan = torch_backend.prepare(layout, FULL)
    page_lists = [torch.tensor(t) for t in tables]

    def gather_sdpa():
        gathered_decode_attention(
            out, q, kc, vc, plan.decode, scale, LayerCall(FULL), torch_backend.workspace
        )

    def per_sequence():
        for g, pages in enumerate(page_lists):
            k = kc[pages].flatten(0, 1)[: ctxs[g]].transpose(0, 1)  # [Hkv, ctx, D]
            v = vc[pages].flatten(0, 1)[: ctxs[g]].transpose(0, 1)
            out[g] = F.scaled_dot_product_attention(q[g].view(Hkv, gqa, D), k, v, scale=scale).flatten(0, 1)

    ways = [gather_sdpa, per_sequence]
    if kernel is not None:
        d = TorchAttention(P, kernel).prepare(layout, FULL).decode

        def paged():
            kernel.paged_decode_attention(out, q, kc, vc, d.block_tables, d.seq_lens, d.token_index, scale)

        ways.append(paged)
    qsl = torch.arange(G + 1, dtype=torch.int32)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    ref = ref_paged_attention(
        q.float(), kc.float(), vc.float(), bt, qsl, torch.tensor(ctxs, dtype=torch.int32), scale
    )
    times = []
    for fn in ways:
        out.fill_(float("nan"))
        fn()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), (fn.__name__, err)
        times.append(best_seconds(fn))
    return times + [float("nan")] * (3 - len(times))


if __name__ == "__main__":
    main()
