"""`make bench`, first half: batchrun against Hugging Face `generate`, and batchrun against itself with a feature
on and off, side by side in one run, reported as ratios. Each measurement runs in its own process (its peak
memory is its own), fp32, greedy, on the same prompts:

1. throughput: >=128 chat prompts of 20-400 tokens, 128 new tokens, eos allowed: batchrun vs HF `generate` with
   padded static batches of the same batch size (and batchrun at 128 sequences);
2. bar: 60 chat prompts of 15-450 tokens, 64 new tokens: batchrun vs HF `generate` in batches of 16 and of 60;
3. preemption: 64 short prompts generating 64 tokens each with a quarter of the KV pages they peak at: swap vs
   recompute vs unconstrained;
4. sharing: 32 rows behind a common ~220-token system prompt: prefix sharing on vs off;
5-7. logprobs 5 vs none, json_object vs free text, 2 replicas of 1 thread vs 1 process of 2 threads: the bar's
   workload, alternated, twice each (the best run of each counts: a cold first run is slow).

Usage: python -m bench.vs_hf [--quick] [--only throughput,bar,preemption,sharing,logprobs,structured,replicas]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from .common import (
    OUT,
    WORDS,
    chat_prompts,
    columns,
    environment,
    in_process,
    peak_rss_mib,
    run_batchrun,
    save,
    write_prompts,
)

MODULE = "bench.vs_hf"


def batchrun_run(work: str, label: str, batch: int, new: int, extra: dict | None = None, system=None) -> dict:
    """One batchrun run (in its own process): fp32 like HF generate here, max_num_seqs = the batch size."""
    extra = extra or {}
    r = run_batchrun(
        Path(work),
        label,
        {
            "model": {"dtype": "float32", "system_prompt": system},
            "sampling": {"max_new_tokens": new, **extra.get("sampling", {})},
            "engine": {"max_num_seqs": batch, **extra.get("engine", {})},
        },
    )
    for key in ("prompt_ids", "completions"):
        r.pop(key)
    return r


def hf_run(work: str, label: str, batch: int, new: int) -> dict:
    """HF `generate`, fp32, greedy, left-padded static batches of `batch` prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from batchrun.model_loader import resolve_model_dir

    torch.set_num_threads(os.cpu_count() or 1)
    prompts = json.loads((Path(work) / "prompts.json").read_text())
    model_dir = resolve_model_dir(None)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]
    generated = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(texts), batch):
            enc = tok(texts[i : i + batch], return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**enc, max_new_tokens=new, do_sample=False, pad_token_id=eos)
            for row in out[:, enc["input_ids"].shape[1] :].tolist():  # up to and including eos, not padding
                generated += row.index(eos) + 1 if eos in row else len(row)
    wall = time.perf_counter() - t0
    return {
        "label": label,
        "generated_tokens": generated,
        "wall_s": wall,
        "tokens_per_s": generated / wall,
        "peak_rss_mib": peak_rss_mib(),
    }


def prepare(work: Path, prompts: list[str]) -> str:
    write_prompts(work, prompts)
    (work / "prompts.json").write_text(json.dumps(prompts))
    return str(work)


def ours(work, label, batch, new, extra=None, system=None) -> dict:
    r = in_process(
        MODULE, "batchrun_run", work=work, label=label, batch=batch, new=new, extra=extra, system=system
    )
    print(f"    {r['tokens_per_s']:.1f} generated tokens/s, peak RSS {r['peak_rss_mib']:.0f} MiB", flush=True)
    return r


def theirs(work, label, batch, new) -> dict:
    return in_process(MODULE, "hf_run", work=work, label=label, batch=batch, new=new)


AB_TESTS = {  # the bar's workload, one feature off (a) and on (b)
    "logprobs": ("logprobs 5 vs without", "plain", {}, "logprobs", {"sampling": {"logprobs": 5}}),
    "structured": (
        "json_object vs free text",
        "free",
        {},
        "json_object",
        {"sampling": {"response_format": {"type": "json_object"}}},
    ),
    "replicas": (
        "2 replicas of 1 thread vs 1 process of 2 threads",
        "one",
        {},
        "two",
        {"engine": {"replicas": 2}},
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--quick", action="store_true", help="smaller workloads (a smoke run, not for RESULTS.md)"
    )
    ap.add_argument("--only", default="throughput,bar,preemption,sharing,logprobs,structured,replicas")
    ap.add_argument("--out", default=str(OUT / "vs-hf.json"))
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from batchrun.model_loader import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    only = set(args.only.split(","))
    n_main, new_main = (32, 32) if args.quick else (128, 128)
    r: dict = {**environment(), "quick": args.quick}
    lines = [
        f"\n== batchrun vs HF generate, {r['date']}, {r['cpu']}, {r['cpus']} CPUs{' (quick)' * args.quick} =="
    ]
    runs_spec = {
        "run": "{label}",
        "generated tok/s": "{tokens_per_s:.1f}",
        "generated tokens": "{generated_tokens}",
        "peak RSS MiB": "{peak_rss_mib:.0f}",
    }

    if "throughput" in only:
        print(f"throughput: {n_main} chat prompts of 20-400 tokens, max_new_tokens {new_main}, batch 32")
        work = prepare(OUT / "throughput", chat_prompts(tok, n_main, 20, 400, seed=1))
        br, hf = ours(work, "batchrun", 32, new_main), theirs(work, "hf-generate-padded", 32, new_main)
        wide = ours(work, "batchrun-128-seqs", 128, new_main)
        t = r["throughput"] = {
            "batchrun": br,
            "hf": hf,
            "batchrun_128": wide,
            "speedup": br["tokens_per_s"] / hf["tokens_per_s"],
            "speedup_128": wide["tokens_per_s"] / hf["tokens_per_s"],
            "memory_ratio": br["peak_rss_mib"] / hf["peak_rss_mib"],
        }
        lines += columns(runs_spec, [br, hf, wide])
        lines.append(
            f"batchrun / HF generate: **{t['speedup']:.2f}x** tokens/s, {t['memory_ratio']:.2f}x peak RSS; "
            f"with max_num_seqs 128: {t['speedup_128']:.2f}x"
        )

    if "bar" in only:
        print("bar: 60 chat prompts of 15-450 tokens, greedy, max_new_tokens 64")
        work = prepare(OUT / "bar60", chat_prompts(tok, 60, 15, 450, seed=5))
        br = ours(work, "batchrun-256-seqs", 256, 64)
        hf16, hf60 = (
            theirs(work, "hf-generate-padded-16", 16, 64),
            theirs(work, "hf-generate-padded-60", 60, 64),
        )
        b = r["bar"] = {
            "batchrun": br,
            "hf16": hf16,
            "hf60": hf60,
            "speedup_16": br["tokens_per_s"] / hf16["tokens_per_s"],
            "speedup_60": br["tokens_per_s"] / hf60["tokens_per_s"],
        }
        lines += ["", *columns(runs_spec, [br, hf16, hf60])]
        lines.append(
            f"batchrun / HF generate: {b['speedup_16']:.2f}x (batches of 16), {b['speedup_60']:.2f}x (of 60)"
        )

    if "preemption" in only:
        n, new = (24, 32) if args.quick else (64, 64)
        print(f"preemption: {n} short prompts, max_new_tokens {new} (ignore_eos), a quarter of the pages")
        work = prepare(OUT / "preemption", chat_prompts(tok, n, 20, 60, seed=2))
        ignore = {"sampling": {"ignore_eos": True}}
        free = ours(work, "unconstrained", 64, new, ignore)
        quarter = max(free["peak_pages_used"] // 4, -(-(60 + new) // 16))
        runs = {"unconstrained": free}
        for way in ("swap", "recompute"):
            runs[way] = ours(
                work, way, 64, new, {**ignore, "engine": {"num_pages": quarter, "preemption": way}}
            )
        r["preemption"] = {**runs, "num_pages": quarter}
        for x in runs.values():
            x["vs_free"] = x["tokens_per_s"] / free["tokens_per_s"]
        spec = {
            f"run ({quarter} pages when constrained)": "{label}",
            "tok/s": "{tokens_per_s:.1f}",
            "preemptions": "{preemptions}",
            "swapped-out pages": "{swap_out_pages}",
            "recomputations": "{recomputations}",
            "vs unconstrained": "{vs_free:.2f}x",
        }
        lines += ["", *columns(spec, list(runs.values()))]

    if "sharing" in only:
        new = 16 if args.quick else 32
        print(f"sharing: 32 rows behind a ~220-token system prompt, max_new_tokens {new}")
        system = (
            "You are the help desk of a city library. Answer visitors' questions about opening hours, "
            "membership, borrowing limits, late fees, study rooms, printing and events in one friendly "
            "sentence. "
        ) * 6
        work = prepare(
            OUT / "sharing", [f"Question {i}: can I {WORDS[i % len(WORDS)]} in room {i}?" for i in range(32)]
        )
        on, off = (
            ours(work, f"sharing-{k}", 32, new, {"engine": {"prefix_sharing": k == "on"}}, system)
            for k in ("on", "off")
        )
        r["sharing"] = {
            "on": on,
            "off": off,
            "speedup": on["tokens_per_s"] / off["tokens_per_s"],
            "peak_pages_ratio": on["peak_pages_used"] / off["peak_pages_used"],
        }
        spec = {
            "run": "{label}",
            "tok/s": "{tokens_per_s:.1f}",
            "peak pages": "{peak_pages_used}",
            "prompt tokens computed": "{prompt_tokens_computed}",
            "duplication saved (peak)": "{duplication_saved_peak:.1%}",
        }
        lines += ["", *columns(spec, [on, off])]
        lines.append(
            f"sharing on / off: {r['sharing']['speedup']:.2f}x tokens/s, "
            f"{r['sharing']['peak_pages_ratio']:.2f}x peak pages"
        )

    for key, (what, a, a_extra, b, b_extra) in AB_TESTS.items():
        if key not in only:
            continue
        print(f"{key}: the bar's workload (60 prompts, 64 new tokens), {what}")
        work = prepare(OUT / key, chat_prompts(tok, 60, 15, 450, seed=5))
        runs: dict[str, list] = {a: [], b: []}
        for i in range(2):
            runs[a].append(ours(work, f"{a}-{i}", 256, 64, a_extra))
            runs[b].append(ours(work, f"{b}-{i}", 256, 64, b_extra))
        best = {k: max(x["tokens_per_s"] for x in v) for k, v in runs.items()}
        r[key] = {**runs, "ratio": best[b] / best[a]}
        spec = runs_spec
        if key == "structured":
            for x in runs[a] + runs[b]:
                x["mask_ms"], x["compile_ms"] = (
                    x["grammar_mask_s"] / x["steps"] * 1e3,
                    x["grammar_compile_s"] * 1e3,
                )
            spec = {
                **runs_spec,
                "rows complete": "{structured_complete}/{structured_rows}",
                "compile ms": "{compile_ms:.1f}",
                "mask ms per step": "{mask_ms:.2f}",
            }
        lines += ["", *columns(spec, runs[a] + runs[b])]
        lines.append(f"{b} / {a}: {r[key]['ratio']:.2f}x generated tokens/s (best run of each)")

    save(r, Path(args.out), "\n".join(lines))


if __name__ == "__main__":
    from .common import serve_one

    if not serve_one({"batchrun_run": batchrun_run, "hf_run": hf_run}):
        main()
