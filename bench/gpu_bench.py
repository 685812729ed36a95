"""GPU check, for the accelerator machine (bench/gpu_check.sh runs it after the kernel tests).

1. Decode-path timing of the paged Triton kernel at batch 64 / 128 / 256 and context 512 / 2048 / 4096
   (Llama-8B-like heads: 32 query heads, 8 KV heads, head dim 128, bf16, 16-token pages in shuffled order),
   against its floor (bytes of K/V it must read / measured device-to-device copy bandwidth) and against
   PyTorch SDPA over K/V gathered into a contiguous copy (the gather included, as a non-paged engine pays it).
2. batchrun (Triton attention) against HF `generate` on the same token ids, on models made here from a config
   with random weights (SmolLM2-135M's shape; an 8B Llama's with 4 layers) and the tokenizer files that travel
   in out/gpu-assets (bench/gpu_assets.sh).
Prints one table (Markdown) at the end; `--out FILE` also writes it.
"""

from __future__ import annotations

import argparse
import gc
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


# model shapes made on the GPU machine with random weights (no checkpoint travels): SmolLM2-135M's, and an
# 8B Llama's with 4 of its 32 layers; both with the tokenizer's vocabulary
_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)
SHAPES = {
    name: {
        **dict(zip(_FIELDS, sizes)),
        "head_dim": head_dim,
        "rope_theta": theta,
        "tie_word_embeddings": tied,
    }
    for name, sizes, head_dim, theta, tied in [
        ("smollm2-135m", (576, 1536, 30, 9, 3), 64, 100000.0, True),
        ("llama-8b-4-layers", (4096, 14336, 4, 32, 8), 128, 500000.0, False),
    ]
}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_model(name: str, tokenizer_dir: Path, work: Path, device: str = "cuda") -> Path:
    """A Llama model of SHAPES[name] with random weights (bf16), saved with the tokenizer files."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tok),
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        **SHAPES[name],
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    target = work / name
    model.save_pretrained(target)
    tok.save_pretrained(target)
    return target


def model_table(
    tokenizer_dir: Path, work: Path, rows: int, new_tokens: int, device: str = "cuda"
) -> list[dict]:
    """batchrun vs HF `generate` (one padded batch) on the same token ids, bf16, greedy, ignore eos.
    (`device`: cpu runs the same code on tiny shapes, to try it without a GPU.)"""
    from transformers import AutoModelForCausalLM

    from batchrun import LLM, SamplingParams

    gen = torch.Generator().manual_seed(1)
    out = []
    for name in SHAPES:
        path = make_model(name, tokenizer_dir, work, device)
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        lens = torch.randint(64, 512, (rows,), generator=gen).tolist()
        prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in lens]
        budget = {"kv_cache_memory": "16GiB"} if device == "cuda" else {"num_pages": 4096}
        llm = LLM(model=str(path), dtype="bfloat16", device=device, max_model_len=1024, **budget)
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up: Triton compiles its kernels here
        sync()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync()
        t_batchrun = time.perf_counter() - t0
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        del llm, outs
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
        width = max(lens)
        pad = hf.config.eos_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        with torch.inference_mode():
            kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
            hf.generate(input_ids=ids[:4], attention_mask=mask[:4], **kw)
            sync()
            t0 = time.perf_counter()
            hf.generate(input_ids=ids, attention_mask=mask, **kw)
            sync()
            t_hf = time.perf_counter() - t0
        del hf
        out.append(
            {
                "model": name,
                "rows": rows,
                "batchrun_tok_s": generated / t_batchrun,
                "hf_tok_s": rows * new_tokens / t_hf,
                "generated": generated,
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokenizer", default=str(ROOT / "out" / "gpu-assets" / "tokenizer"))
    ap.add_argument("--work", default="/tmp/batchrun-gpu-models")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "the GPU check needs CUDA"
    name = torch.cuda.get_device_name()
    decode, bw = decode_table()
    models = model_table(Path(args.tokenizer), Path(args.work), args.rows, args.new_tokens)
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
    lines += [
        "",
        "| model (random weights, bf16) | rows | batchrun tok/s | HF generate tok/s (one padded batch) | ratio |",
        "|---|---|---|---|---|",
    ]
    for r in models:
        lines.append(
            f"| {r['model']} | {r['rows']} | {r['batchrun_tok_s']:.0f} | {r['hf_tok_s']:.0f} | "
            f"{r['batchrun_tok_s'] / r['hf_tok_s']:.2f}x |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
