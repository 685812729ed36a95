"""GPU check, for the accelerator machine (bench/gpu_check.sh runs it, `python -m bench.gpu_bench`, after the
kernel tests).

1. Decode-path timing of the paged Triton kernel at batch 64 / 128 / 256 and context 512 / 2048 / 4096
   (Llama-8B-like heads: 32 query heads, 8 KV heads, head dim 128, bf16, 16-token pages in shuffled order),
   against its floor (bytes of K/V it must read / measured device-to-device copy bandwidth) and against
   PyTorch SDPA over K/V gathered into a contiguous copy (the gather included, as a non-paged engine pays it).
2. batchrun (Triton attention, and the gather backend) against HF `generate` in bf16 on the same token ids:
   tokens/s, host time per step, rows and first tokens equal to HF's, on models made here from a config with
   random weights (SmolLM2-135M's shape; an 8B Llama's with 4 layers) and the tokenizer files that travel in
   out/gpu-assets (bench/gpu_assets.sh).
fp32 exactness on CUDA is a test (tests/test_kernels.py, which gpu_check.sh runs first). A section that fails
is reported in the table and the next one still runs. Prints one report (Markdown) at the end; `--out FILE`
writes it after every section."""

from __future__ import annotations

import argparse
import gc
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from .common import ROOT, columns, random_model


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

    torch.cuda.empty_cache()  # the last case's pages
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
    floor = (
        kv_bytes / bw
    )  # bw counts the copy's reads and writes (the memory's traffic); attention reads K/V once
    return {
        "batch": batch,
        "context": ctx,
        "kernel_ms": t_kernel * 1e3,
        "floor_ms": floor * 1e3,
        "of_floor": floor / t_kernel,
        "gather_sdpa_ms": t_sdpa * 1e3,
        "vs_sdpa": t_sdpa / t_kernel,
    }


DECODE_COLUMNS = {  # the decode table's header and how each cell shows a row of `time_decode`
    "batch": "{batch}",
    "context": "{context}",
    "paged kernel ms": "{kernel_ms:.3f}",
    "floor ms": "{floor_ms:.3f}",
    "% of floor": "{of_floor:.0%}",
    "gather + SDPA ms": "{gather_sdpa_ms:.3f}",
    "vs SDPA": "{vs_sdpa:.2f}x",
}


def decode_table() -> tuple[list[dict], float]:
    bw = copy_bandwidth()
    return [time_decode(batch, ctx, bw) for batch in (64, 128, 256) for ctx in (512, 2048, 4096)], bw


# model shapes made on the GPU machine with random weights (no checkpoint travels): SmolLM2-135M's, and an
# 8B Llama's with 4 of its 32 layers; both with the tokenizer's vocabulary. Fields: hidden, intermediate,
# layers, query heads, KV heads, head dim, rope theta, tied embeddings.
_FIELDS = "hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads head_dim"
SHAPES = {
    name: {**dict(zip(_FIELDS.split(), sizes)), "rope_theta": theta, "tie_word_embeddings": tied}
    for name, sizes, theta, tied in [
        ("smollm2-135m", (576, 1536, 30, 9, 3, 64), 100000.0, True),
        ("llama-8b-4-layers", (4096, 14336, 4, 32, 8, 128), 500000.0, False),
    ]
}


def make_model(name: str, tokenizer_dir: Path, work: Path, device: str = "cuda") -> Path:
    """A Llama model of SHAPES[name] with random weights (bf16), saved with the tokenizer files."""
    from transformers import AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config = LlamaConfig(max_position_embeddings=4096, **ids, **SHAPES[name])
    return random_model(config, work, name, tokenizer_dir, torch.bfloat16, device)


def hf_generate(hf, prompts: list[list[int]], new_tokens: int, device: str) -> list[list[int]]:
    """HF `generate`, greedy, exactly `new_tokens` new tokens, one left-padded batch."""
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    pad = hf.config.eos_token_id
    with torch.inference_mode():
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        return hf.generate(input_ids=ids, attention_mask=mask, pad_token_id=pad, **kw)[:, width:].tolist()


def random_prompts(
    rows: int, gen: torch.Generator, shortest: int = 64, longest: int = 512
) -> list[list[int]]:
    lens = torch.randint(shortest, longest, (rows,), generator=gen).tolist()
    return [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in lens]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def run_batchrun(path: Path, prompts, new_tokens: int, dtype: str, device: str, attention: str) -> dict:
    """Token ids, seconds and the per-step host phases of one batchrun run (after a warm-up on 4 rows)."""
    from batchrun import LLM, SamplingParams

    budget = {"kv_cache_memory": "16GiB"} if device == "cuda" else {"num_pages": 4096}
    llm = LLM(model=str(path), dtype=dtype, device=device, max_model_len=1024, attention=attention, **budget)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up: Triton compiles its kernels here
    engine = llm.engine
    steps = 0
    step = engine.step

    def counted_step():
        nonlocal steps
        steps += 1
        return step()

    engine.step = counted_step
    before = dict(engine.times.seconds)
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - t0
    phases = {k: (v - before[k]) * 1e3 / max(steps, 1) for k, v in engine.times.seconds.items()}
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    del llm, outs, engine
    free(device)
    return {"tokens": tokens, "seconds": seconds, "steps": steps, "ms_per_step": phases}


def model_table(
    tokenizer_dir: Path, work: Path, rows: int, new_tokens: int, device: str = "cuda"
) -> Iterator[dict]:
    """batchrun (Triton attention, and the gather + SDPA backend) vs HF `generate` (one padded batch) on the
    same token ids, bf16, greedy, ignore eos. (`device`: cpu runs the same code on tiny shapes, to try it
    without a GPU.)"""
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(1)
    for name in SHAPES:
        path = make_model(name, tokenizer_dir, work, device)
        free(device)
        prompts = random_prompts(rows, gen)
        row = {"model": name, "rows": rows, "new_tokens": new_tokens}
        for attention in ("triton", "gather") if device == "cuda" else ("auto",):
            try:
                row[attention] = run_batchrun(path, prompts, new_tokens, "bfloat16", device, attention)
            except Exception as e:  # one backend failing must not hide the others' figures
                traceback.print_exc()
                row[attention] = {"error": f"{type(e).__name__}: {e}"}
                free(device)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
        hf_generate(hf, prompts[:4], new_tokens, device)  # warm-up
        sync()
        t0 = time.perf_counter()
        row["hf_tokens"] = hf_generate(hf, prompts, new_tokens, device)
        sync()
        row["hf_seconds"] = time.perf_counter() - t0
        del hf
        free(device)
        print("\n".join(model_lines(row)), flush=True)
        yield row


MODEL_COLUMNS = {
    "model (random weights)": "{model}",
    "attention": "{attention}",
    "rows": "{rows}",
    "batchrun tok/s": "{tok_s:.0f}",
    "HF tok/s": "{hf_tok_s:.0f}",
    "ratio": "{ratio:.2f}x",
    "steps": "{steps}",
    "ms/step host / forward / sample": "{host:.2f} / {forward:.2f} / {sample:.2f}",
    "rows identical": "{same}/{rows}",
    "first tokens identical": "{first}/{rows}",
}


def model_lines(r: dict) -> list[str]:
    """The MODEL_COLUMNS table's lines of one `model_table` row: a line per backend (a failed one says why)."""
    lines = []
    hf_tok_s = r["rows"] * r["new_tokens"] / r["hf_seconds"]
    for backend in ("triton", "gather", "auto"):
        b = r.get(backend)
        if b is None or "error" in b:
            lines += [f"| {r['model']} | {backend} | failed: {b['error'][:200]} |"] if b else []
            continue
        ph, tokens, hf = b["ms_per_step"], b["tokens"], r["hf_tokens"]
        tok_s = sum(map(len, tokens)) / b["seconds"]
        row = dict(
            r, attention=backend, tok_s=tok_s, hf_tok_s=hf_tok_s, ratio=tok_s / hf_tok_s, steps=b["steps"]
        )
        row |= dict(
            host=sum(ph[k] for k in ("schedule", "prepare", "finish", "stats")), forward=ph["forward"]
        )
        row |= dict(sample=ph["sample"], same=sum(a == h for a, h in zip(tokens, hf)))
        row |= dict(first=sum(a[:1] == h[:1] for a, h in zip(tokens, hf)))
        lines += columns(MODEL_COLUMNS, [row])[2:]
    return lines


class Report(list):
    """The check's lines, written to `path` after every addition, so a run cut short still leaves what it got."""

    def __init__(self, path: str | None):
        super().__init__()
        self.path = Path(path) if path else None

    def add(self, *lines: str) -> None:
        self.extend(lines)
        if self.path:
            self.path.write_text("\n".join(self) + "\n")

    def section(self, title: str, fn) -> None:
        """Run one section; a failure is reported in the table and the next section still runs."""
        print(f"== {title}", flush=True)
        try:
            fn()
        except Exception as e:
            traceback.print_exc()
            self.add("", f"**{title} failed**: {type(e).__name__}: {str(e)[:500]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokenizer", default=str(ROOT / "out" / "gpu-assets" / "tokenizer"))
    ap.add_argument("--work", default="/tmp/batchrun-gpu-models")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "the GPU check needs CUDA"
    tokenizer, work = Path(args.tokenizer), Path(args.work)
    report = Report(args.out)
    report.add(
        f"GPU check on {torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}"
    )

    def decode():
        rows, bw = decode_table()
        report.add(
            "",
            f"Decode attention (32 query / 8 KV heads, head dim 128, bf16, 16-token pages shuffled); floor = K/V bytes "
            f"/ the measured copy bandwidth ({bw / 1e9:.0f} GB/s, its reads and writes counted)",
            "",
            *columns(DECODE_COLUMNS, rows),
        )

    def models():
        report.add(
            "",
            f"bf16, greedy, {args.new_tokens} new tokens a row, prompts of 64-511 random tokens; HF `generate`: one "
            "left-padded batch. ms per step: host (schedule + prepare + finish + stats) / forward (launches; the "
            "device's time shows where the host first waits) / sample. Identical: rows (and first new tokens) equal "
            "to HF's; in bf16 informative only: batch shapes change the rounding, and one flipped token changes the "
            "rest of its row",
            "",
            *columns(MODEL_COLUMNS, []),  # the header; a row per model as it is measured
        )
        for r in model_table(tokenizer, work, args.rows, args.new_tokens):
            report.add(*model_lines(r))

    report.section("decode attention", decode)
    report.section("models", models)
    print("\n".join(report))


if __name__ == "__main__":
    main()
