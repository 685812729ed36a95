"""GPU check, for the accelerator machine (bench/gpu_check.sh runs it, `python -m bench.gpu_bench`, after the
kernel tests).

1. Decode-path timing of the paged Triton kernel at batch 64 / 128 / 256 and context 512 / 2048 / 4096
   (Llama-8B-like heads: 32 query heads, 8 KV heads, head dim 128, bf16, 16-token pages in shuffled order),
   against its floor (bytes of K/V it must read / measured device-to-device copy bandwidth) and against
   PyTorch SDPA over K/V gathered into a contiguous copy (the gather included, as a non-paged engine pays it).
2. fp32 exactness: batchrun's batch against HF `generate` one row at a time, token for token.
3. batchrun (Triton attention, and the gather backend) against HF `generate` in bf16 on the same token ids:
   tokens/s, host time per step, rows and first tokens equal to HF's.
2 and 3 run on models made here from a config with random weights (SmolLM2-135M's shape; an 8B Llama's with 4
layers) and the tokenizer files that travel in out/gpu-assets (bench/gpu_assets.sh). Each section that fails
is reported in the table and the next one still runs. Prints one report (Markdown) at the end; `--out FILE`
writes it after every section."""

from __future__ import annotations

import argparse
import gc
import re
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
    rows = []
    for batch in (64, 128, 256):
        for ctx in (512, 2048, 4096):
            rows.append(time_decode(batch, ctx, bw))
            torch.cuda.empty_cache()
    return rows, bw


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


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_model(name: str, tokenizer_dir: Path, work: Path, device: str = "cuda") -> Path:
    """A Llama model of SHAPES[name] with random weights (bf16), saved with the tokenizer files."""
    from transformers import AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config = LlamaConfig(max_position_embeddings=4096, **ids, **SHAPES[name])
    return random_model(config, work, name, tokenizer_dir, torch.bfloat16, device)


def hf_generate(hf, prompts: list[list[int]], new_tokens: int, device: str, batch: bool) -> list[list[int]]:
    """HF `generate`, greedy, exactly `new_tokens` new tokens: one left-padded batch, or one call per row."""
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    pad = hf.config.eos_token_id
    with torch.inference_mode():
        if not batch:
            one = lambda p: hf.generate(input_ids=torch.tensor([p], device=device), pad_token_id=pad, **kw)  # noqa: E731
            return [one(p)[0, len(p) :].tolist() for p in prompts]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        return hf.generate(input_ids=ids, attention_mask=mask, pad_token_id=pad, **kw)[:, width:].tolist()


def random_prompts(
    rows: int, gen: torch.Generator, shortest: int = 64, longest: int = 512
) -> list[list[int]]:
    lens = torch.randint(shortest, longest, (rows,), generator=gen).tolist()
    return [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in lens]


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


def exactness(
    name: str, tokenizer_dir: Path, work: Path, rows: int = 8, new_tokens: int = 24, device: str = "cuda"
) -> dict:
    """fp32: batchrun (Triton attention) against HF `generate` run one row at a time (no padding), token for
    token, on the shape SHAPES[name] with random weights."""
    from transformers import AutoModelForCausalLM

    path = make_model(name, tokenizer_dir, work, device)
    prompts = random_prompts(rows, torch.Generator().manual_seed(2), 16, 300)
    ours = run_batchrun(path, prompts, new_tokens, "float32", device, "auto")["tokens"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    ref = hf_generate(hf, prompts, new_tokens, device, batch=False)
    del hf
    free(device)
    same = sum(a == b for a, b in zip(ours, ref))
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(ours, ref)]
    return {
        "model": name,
        "rows": rows,
        "new_tokens": new_tokens,
        "identical": same,
        "first_difference": first_diff,
    }


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
        hf_generate(hf, prompts[:4], new_tokens, device, batch=True)  # warm-up
        sync()
        t0 = time.perf_counter()
        row["hf_tokens"] = hf_generate(hf, prompts, new_tokens, device, batch=True)
        sync()
        row["hf_seconds"] = time.perf_counter() - t0
        del hf
        free(device)
        print("\n".join(row_lines(row)), flush=True)
        yield row


def row_lines(r: dict) -> list[str]:
    hf_tok_s = r["rows"] * r["new_tokens"] / r["hf_seconds"]
    lines = []
    for backend in ("triton", "gather", "auto"):
        b = r.get(backend)
        if b is None:
            continue
        if "error" in b:
            lines.append(f"| {r['model']} | {backend} | failed: {b['error'][:200]} | | | | | | |")
            continue
        generated = sum(map(len, b["tokens"]))
        tok_s = generated / b["seconds"]
        ph = b["ms_per_step"]
        host = sum(ph[k] for k in ("schedule", "prepare", "finish", "stats"))
        same = sum(a == h for a, h in zip(b["tokens"], r["hf_tokens"]))
        first = sum(a[:1] == h[:1] for a, h in zip(b["tokens"], r["hf_tokens"]))
        lines.append(
            f"| {r['model']} | {backend} | {r['rows']} | {tok_s:.0f} | {hf_tok_s:.0f} | {tok_s / hf_tok_s:.2f}x | "
            f"{b['steps']} | {host:.2f} / {ph['forward']:.2f} / {ph['sample']:.2f} | {same}/{r['rows']} | "
            f"{first}/{r['rows']} |"
        )
    return lines


class Report:
    """The check's table, written to `path` after every section, so a run cut short still leaves what it got."""

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        self.lines: list[str] = []

    def add(self, *lines: str) -> None:
        self.lines += lines
        if self.path:
            self.path.write_text("\n".join(self.lines) + "\n")

    def section(self, title: str, fn) -> None:
        """Run one section; a failure is reported in the table and the next section still runs."""
        print(f"== {title}", flush=True)
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:
            traceback.print_exc()
            self.add("", f"**{title} failed**: {type(e).__name__}: {str(e)[:500]}")
        print(f"== {title}: {time.perf_counter() - t0:.0f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--kernel-tests", default=None, help="pytest's output for the kernel tests (its last line)"
    )
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
    if args.kernel_tests:
        lines = Path(args.kernel_tests).read_text().splitlines()
        said = [ln.strip("= ") for ln in lines if re.search(r"\d+ (passed|failed|error)|exit \d+", ln)]
        report.add(
            "", f"Kernel tests on CUDA (`pytest tests/test_kernels.py`): {'; '.join(said) or 'no summary'}"
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

    def exact():
        report.add(
            "",
            "fp32, batchrun (Triton) vs HF `generate` one row at a time, token for token (random weights):",
        )
        for name in SHAPES:
            r = exactness(name, tokenizer, work)
            report.add(
                f"- {name}: {r['identical']}/{r['rows']} rows of {r['new_tokens']} tokens identical; "
                f"first differing position per row: {r['first_difference']}"
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
            "| model (random weights) | attention | rows | batchrun tok/s | HF tok/s | ratio | steps | "
            "ms/step host / forward / sample | rows identical | first tokens identical |",
            "|---|---|---|---|---|---|---|---|---|---|",
        )
        for r in model_table(tokenizer, work, args.rows, args.new_tokens):
            report.add(*row_lines(r))

    report.section("decode attention", decode)
    report.section("fp32 exactness", exact)
    report.section("models", models)
    print("\n".join(report.lines))


if __name__ == "__main__":
    main()
