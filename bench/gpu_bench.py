"""GPU check, for the accelerator machine (bench/gpu_check.sh runs it after the kernel tests).

1. Decode-path timing of the paged Triton kernel at batch 64 / 128 / 256 and context 512 / 2048 / 4096
   (Llama-8B-like heads: 32 query heads, 8 KV heads, head dim 128, bf16, 16-token pages in shuffled order),
   against its floor (bytes of K/V it must read / measured device-to-device copy bandwidth) and against
   PyTorch SDPA over K/V gathered into a contiguous copy (the gather included, as a non-paged engine pays it).
2. A whole demo job with `attention: triton` against `attention: torch`.
Prints one table (Markdown) at the end; `--out FILE` also writes it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def cuda_time(fn, iters: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3  # seconds


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), on a 2 GiB buffer."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    t = cuda_time(lambda: b.copy_(a), iters=10)
    return 2 * a.numel() * a.element_size() / t


def time_decode(batch: int, ctx: int, bw: float) -> dict:
    from batchrun_kernels import paged_attention, plan_query_blocks

    Hq, Hkv, D, P = 32, 8, 128, 16
    dtype = torch.bfloat16
    blocks = ctx // P
    num_pages = batch * blocks
    k_cache = torch.randn(num_pages, P, Hkv, D, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_pages, device="cuda").view(batch, blocks).to(torch.int32)
    q = torch.randn(batch, Hq, D, dtype=dtype, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    scale = D**-0.5
    grid = plan_query_blocks([1] * batch, Hq // Hkv, "cuda")  # built once, as the engine does per step

    def kernel():
        paged_attention(q, k_cache, v_cache, tables, qsl, seq_lens, scale, grid, out=out)

    def gather_sdpa():
        k = k_cache[tables.long()].view(batch, ctx, Hkv, D).transpose(1, 2)
        v = v_cache[tables.long()].view(batch, ctx, Hkv, D).transpose(1, 2)
        return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)

    t_kernel = cuda_time(kernel)
    t_sdpa = cuda_time(gather_sdpa)
    kv_bytes = 2 * batch * ctx * Hkv * D * k_cache.element_size()
    floor = kv_bytes / (bw / 2)  # the copy moved each byte twice (read + write); attention reads it once
    return {
        "batch": batch,
        "context": ctx,
        "kernel_ms": t_kernel * 1e3,
        "floor_ms": floor * 1e3,
        "of_floor": floor / t_kernel,
        "gather_sdpa_ms": t_sdpa * 1e3,
        "vs_sdpa": t_sdpa / t_kernel,
    }


def decode_table() -> tuple[list[dict], float]:
    bw = copy_bandwidth()
    rows = []
    for batch in (64, 128, 256):
        for ctx in (512, 2048, 4096):
            rows.append(time_decode(batch, ctx, bw))
            torch.cuda.empty_cache()
    return rows, bw


def job_table(limit: int) -> list[dict]:
    rows = []
    for attention in ("triton", "torch"):
        out = ROOT / "out" / f"gpu-demo-{attention}"
        cmd = [
            str(Path(sys.executable).parent / "batchrun"),
            "submit",
            str(ROOT / "jobs" / "demo.yaml"),
            "--quiet",
            "--overwrite",
            "--limit",
            str(limit),
            "--set",
            f"engine.attention={attention}",
            "--set",
            "engine.device=cuda",
            "--set",
            f"output.path={out}",
        ]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            rows.append({"attention": attention, "error": proc.stderr[-2000:]})
            continue
        summary = json.loads(
            subprocess.run(
                [
                    str(Path(sys.executable).parent / "batchrun"),
                    "stats",
                    str(out / "stats.parquet"),
                    "--json",
                ],
                capture_output=True,
                text=True,
            ).stdout
        )
        rows.append(
            {
                "attention": attention,
                "wall_s": wall,
                "job_s": summary["wall_s"],
                "generated_tokens_per_s": summary["generated_tokens_per_s"],
                "generated_tokens": summary["generated_tokens"],
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--limit", type=int, default=240)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "the GPU check needs CUDA"
    name = torch.cuda.get_device_name()
    decode, bw = decode_table()
    jobs = job_table(args.limit)
    lines = [
        f"GPU check on {name}, {time.strftime('%Y-%m-%d')}, torch {torch.__version__}; "
        f"D2D copy bandwidth {bw / 1e9:.0f} GB/s (read + write)",
        "",
        "| batch | context | paged kernel ms | floor ms | % of floor | gather + SDPA ms | speed-up vs SDPA |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in decode:
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['kernel_ms']:.3f} | {r['floor_ms']:.3f} | "
            f"{r['of_floor']:.0%} | {r['gather_sdpa_ms']:.3f} | {r['vs_sdpa']:.2f}x |"
        )
    lines += ["", "| demo job | job s | generated tok/s | generated tokens |", "|---|---|---|---|"]
    for r in jobs:
        if "error" in r:
            lines.append(f"| {r['attention']} | failed: {r['error'][-200:]!r} | | |")
        else:
            lines.append(
                f"| attention: {r['attention']} | {r['job_s']:.1f} | {r['generated_tokens_per_s']:.1f} | "
                f"{r['generated_tokens']} |"
            )
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
