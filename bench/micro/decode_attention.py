"""One layer's decode attention at W's first all-decode bf16 step, in one thread's CPU time (issue 50, item 3):
60 sequences, contexts drawn in [240, 400] with a fixed seed, SmolLM2-135M's shape (9 query heads over 3 KV
heads, head dim 64), bf16 K/V in shuffled pages of 16. Three ways on the same inputs: the C++ decode kernel
(`paged_decode_attention`, cpu_kernels.cpp), the C++ prompt kernel given one query per sequence
(`paged_prompt_attention`, cpu_prompt_attention.cpp), and plain PyTorch (fp32 arithmetic on the same bf16 inputs,
one sequence at a time), which is also the reference of each way's error (relative, in norm). Alternated,
best/median of `--repeat`; GB/s count the K/V bytes of the visible keys once, GFLOP/s the two products
(2 x 2 x D x context x Hq per sequence).

Usage: OMP_NUM_THREADS=1 python -m bench.micro.decode_attention [--sequences 60] [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from batchrun.engine.cpu_kernels import load

from .prompt_attention import HKV, HQ, PAGE, D, alternate  # SmolLM2-135M's shape, one thread's CPU time


def decode_case(sequences: int, seed: int = 0):
    """bf16 pages holding each sequence's context (shuffled page ids) and one query per sequence."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(240, 401, (sequences,), generator=gen).tolist()
    pages = [-(-n // PAGE) for n in lens]
    order = torch.randperm(sum(pages), generator=gen).int()
    tables = torch.zeros(sequences, max(pages), dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages):
        tables[i, :n] = order[used : used + n]
        used += n
    k_cache = torch.randn(sum(pages), PAGE, HKV, D, generator=gen).bfloat16()
    v_cache = torch.randn(sum(pages), PAGE, HKV, D, generator=gen).bfloat16()
    query = torch.randn(sequences, HQ, D, generator=gen).bfloat16()
    return query, k_cache, v_cache, tables, lens


def torch_decode(out, query, k_cache, v_cache, tables, lens, scale) -> None:
    """Plain PyTorch: each sequence's context gathered from its pages, fp32 scores, softmax, times V."""
    for s, n in enumerate(lens):
        pages = tables[s, : -(-n // PAGE)].long()
        k = k_cache[pages].flatten(0, 1)[:n].float().repeat_interleave(HQ // HKV, 1).transpose(0, 1)
        v = v_cache[pages].flatten(0, 1)[:n].float().repeat_interleave(HQ // HKV, 1).transpose(0, 1)
        q = query[s].float()[:, None]  # [Hq, 1, D]
        probs = (q @ k.transpose(1, 2) * scale).softmax(-1)
        out[s] = (probs @ v)[:, 0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequences", type=int, default=60)
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
    kernel = load()
    if kernel is None:
        raise SystemExit("the C++ kernels are not built here (no compiler)")
    query, k_cache, v_cache, tables, lens = decode_case(a.sequences)
    G, scale = len(lens), D**-0.5
    ctx = sum(lens)
    gflop = 2 * 2 * D * ctx * HQ / 1e9
    gbytes = 2 * ctx * HKV * D * 2 / 1e9
    print(
        f"threads: {torch.get_num_threads()}; {G} sequences, {ctx} keys, {gflop:.3f} GFLOP, {gbytes * 1e3:.1f} MB"
    )
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    seq_lens, rows, ones = i32(lens), torch.arange(G), i32([1] * G)
    out = {name: torch.empty(G, HQ, D, dtype=dt) for name, dt in
           [("decode kernel", torch.bfloat16), ("prompt kernel", torch.bfloat16), ("PyTorch fp32", torch.float32)]}  # fmt: skip
    ways = {
        "decode kernel": lambda: kernel.paged_decode_attention(
            out["decode kernel"], query, k_cache, v_cache, tables, seq_lens, rows, scale
        ),
        "PyTorch fp32": lambda: torch_decode(
            out["PyTorch fp32"], query, k_cache, v_cache, tables, lens, scale
        ),
    }
    if kernel.prompt_attention_bf16_supported(D, D, HQ // HKV):
        ways["prompt kernel"] = lambda: kernel.paged_prompt_attention(
            out["prompt kernel"], query, k_cache, v_cache, tables, i32(range(G)), ones, seq_lens, scale
        )
    times = alternate(ways, a.repeat)
    ref = out["PyTorch fp32"]
    for name, ts in times.items():
        best, med = min(ts), statistics.median(ts)
        err = ((out[name].float() - ref).norm() / ref.norm()).item()
        print(
            f"{name:14s} best {best:7.2f} ms  median {med:7.2f} ms  {gbytes / best * 1e3:6.1f} GB/s"
            f"  {gflop / best * 1e3:6.1f} GFLOP/s  err {err:.1e}"
        )


if __name__ == "__main__":
    main()
