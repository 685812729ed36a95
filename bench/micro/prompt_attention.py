"""One layer's prompt attention at a W-like prefill step, in one thread's CPU time (issue 50, item 3): the bf16
C++ kernel (cpu_prompt_attention.cpp, one call for every prompt) against today's SDPA loop (`prefill_attention`,
one call per prompt) in bf16 and in fp32. SmolLM2-135M's shape (9 query heads over 3 KV heads, head dim 64),
`--prompts` whole prompts of random lengths in [100, 400], their K/V written to shuffled pages of 16 first.
Alternated, best/median of `--repeat`; GFLOP/s count the causal products only (2 products x 2 x D x visible
pairs x Hq). The kernel's output is compared with the fp32 loop's (relative error in norm).

Usage: OMP_NUM_THREADS=1 python -m bench.micro.prompt_attention [--prompts 35] [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from batchrun.engine.attention.backends.prompts import PrefillSequence, prefill_attention
from batchrun.engine.attention.layers import LayerCall
from batchrun.engine.attention.masks import FULL
from batchrun.engine.cpu_kernels import load

HQ, HKV, D, PAGE = 9, 3, 64, 16  # SmolLM2-135M


def cpu_ms(fn) -> float:
    t0 = time.thread_time()
    fn()
    return (time.thread_time() - t0) * 1e3


def alternate(ways: dict, repeat: int) -> dict[str, list[float]]:
    """Each way once to warm up, then all of them in turn `repeat` times: {name: [thread CPU ms]}."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    for fn in ways.values():
        fn()
    for _ in range(repeat):
        for name, fn in ways.items():
            times[name].append(cpu_ms(fn))
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=35)
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
    kernel = load()
    if kernel is None or not kernel.prompt_attention_bf16_supported(D, D, HQ // HKV):
        raise SystemExit("the bf16 prompt kernel is not built here (no compiler, or no AVX512-BF16)")
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(100, 401, (a.prompts,), generator=gen).tolist()
    T, scale = sum(lens), D**-0.5
    starts = [sum(lens[:i]) for i in range(len(lens))]
    pairs = sum(n * (n + 1) // 2 for n in lens)
    gflop = 2 * 2 * D * pairs * HQ / 1e9
    print(f"threads: {torch.get_num_threads()}; {a.prompts} prompts, {T} tokens, {gflop:.2f} GFLOP (causal)")

    q32 = torch.randn(T, HQ, D, generator=gen)
    k32, v32 = torch.randn(T, HKV, D, generator=gen), torch.randn(T, HKV, D, generator=gen)
    pages = [-(-n // PAGE) for n in lens]
    order = torch.randperm(sum(pages), generator=gen).int()
    width = max(pages)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    k_cache = torch.zeros(sum(pages), PAGE, HKV, D, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    used = 0
    for i, (n, s) in enumerate(zip(lens, starts)):
        tables[i, : pages[i]] = order[used : used + pages[i]]
        used += pages[i]
        slots = torch.arange(n)
        page_ids = tables[i].long()[slots // PAGE]
        k_cache[page_ids, slots % PAGE] = k32[s : s + n].bfloat16()
        v_cache[page_ids, slots % PAGE] = v32[s : s + n].bfloat16()
    prefills = [PrefillSequence(s, n, n, None, True, None, None, None) for s, n in zip(starts, lens)]
    call = LayerCall(FULL)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    starts_t, lens_t = i32(starts), i32(lens)
    q16, k16, v16 = q32.bfloat16(), k32.bfloat16(), v32.bfloat16()
    out = {name: torch.empty(T, HQ, D, dtype=dt) for name, dt in
           [("kernel bf16", torch.bfloat16), ("SDPA loop bf16", torch.bfloat16), ("SDPA loop fp32", torch.float32)]}  # fmt: skip
    ways = {
        "kernel bf16": lambda: kernel.paged_prompt_attention(
            out["kernel bf16"], q16, k_cache, v_cache, tables, starts_t, lens_t, lens_t, scale
        ),
        "SDPA loop bf16": lambda: prefill_attention(
            out["SDPA loop bf16"], q16, k16, v16, k_cache, v_cache, prefills, scale, call
        ),
        "SDPA loop fp32": lambda: prefill_attention(
            out["SDPA loop fp32"], q32, k32, v32, None, None, prefills, scale, call
        ),
    }
    times = alternate(ways, a.repeat)
    ref = out["SDPA loop fp32"]
    for name, ts in times.items():
        best, med = min(ts), statistics.median(ts)
        err = ((out[name].float() - ref).norm() / ref.norm()).item()
        print(
            f"{name:16s} best {best:8.1f} ms  median {med:8.1f} ms  {gflop / best * 1e3:6.2f} GFLOP/s  err {err:.1e}"
        )


if __name__ == "__main__":
    main()
