"""`make bench`: batchrun against its peer, side by side in one run, reported as ratios.

Each measurement runs in its own subprocess (so its peak memory is its own), on the same prompts:
1. throughput: >=128 chat prompts of 20-400 tokens, max_new_tokens 128, eos allowed — batchrun vs Hugging Face
   `generate` with padded static batches of the same batch size;
2. bar: the brief's reference workload, 60 chat prompts of 15-450 tokens, 64 new tokens — batchrun at its
   default max_num_seqs vs HF `generate` padded in batches of 16 and of 60;
3. preemption: 64 short prompts generating 64 tokens each, with a quarter of the KV pages they peak at — swap
   vs recompute vs unconstrained;
4. sharing: 32 rows behind a common ~220-token system prompt — prefix sharing on vs off;
5. logprobs: the reference workload with `sampling.logprobs: 5` vs without, alternated, twice each;
6. structured: the reference workload with `response_format: {type: json_object}` vs free text, alternated,
   twice each, with the grammar compile and mask times from the summary;
7. replicas: the reference workload with `--replicas 2` (one thread each) vs one process with two threads,
   alternated, twice each.

Usage: python bench/run_bench.py [--quick] [--only throughput,bar,preemption,sharing,logprobs,structured,replicas]
       [--out out/bench-last.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = (
    "river stone paper light window garden music number planet engine silver forest market winter "
    "bridge letter signal harbor candle mirror ladder basket circle thunder meadow"
).split()


def make_prompts(tok, n: int, lo: int, hi: int, seed: int = 0) -> list[str]:
    """Chat prompts whose templated length is roughly uniform in [lo, hi] tokens."""
    rng = random.Random(seed)
    asks = [
        "Summarise the notes above in two sentences.",
        "What do these words have in common?",
        "Write a short poem using some of these words.",
        "Explain the list above to a child.",
        "Pick three words above and tell a tiny story.",
    ]
    prompts = []
    for _ in range(n):
        target = rng.randint(lo, hi)
        ask = rng.choice(asks)
        words: list[str] = []
        while True:
            text = (" ".join(words) + "\n" + ask).strip()
            ids = tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            if len(tok(ids, add_special_tokens=False)["input_ids"]) >= target:
                break
            words += rng.sample(WORDS, 8)
        prompts.append(text)
    return prompts


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---- one measurement, run in a subprocess ----------------------------------------------------------------------
def run_batchrun(args) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchrun.config import load_job
    from batchrun.job import Job

    work = Path(args.work)
    prompts = json.loads((work / "prompts.json").read_text())
    data = work / "prompts.parquet"
    if not data.exists():
        pq.write_table(pa.table({"id": list(range(len(prompts))), "prompt": prompts}), data)
    out = work / f"out-{args.label}"
    overrides = [
        f"input.parquet={data}",
        f"output.path={out}",
        f"sampling.max_new_tokens={args.max_new_tokens}",
        f"engine.max_num_seqs={args.batch}",
        "input.id_column=id",
        "model.dtype=float32",  # like for like with HF generate in fp32 (auto is bf16 on a bf16-capable CPU)
        *args.set,
    ]
    spec = load_job(ROOT / "jobs" / "demo.yaml", overrides)
    spec.input.passthrough = []
    spec.model.system_prompt = args.system
    t0 = time.perf_counter()
    summary = Job(spec, overwrite=True, progress=False).run()
    wall = time.perf_counter() - t0
    rows = [
        n
        for part in sorted(out.glob("part-*.parquet"))
        for n in pq.read_table(part, columns=["completion_tokens"]).column("completion_tokens").to_pylist()
    ]
    gen_s = summary["wall_s"]
    return {
        "label": args.label,
        "generated_tokens": sum(rows),
        "gen_wall_s": gen_s,
        "total_wall_s": wall,
        "tokens_per_s": sum(rows) / gen_s,
        "peak_rss_mib": peak_rss_mib(),
        "peak_pages_used": summary["peak_pages_used"],
        "pages_total": summary["pages_total"],
        "preemptions": summary["preemptions"],
        "swap_out_pages": summary["swap_out_pages"],
        "recomputations": summary["recomputations"],
        "prompt_tokens_computed": summary["prompt_tokens_computed"],
        "duplication_saved_peak": summary["duplication_saved_peak"],
        "kv_utilization_mean": summary["kv_utilization_mean"],
        "steps": summary["steps"],
        "structured_rows": summary["structured_rows"],
        "structured_complete": summary["structured_complete"],
        "grammar_compile_s": summary["grammar_compile_s"],
        "grammar_mask_s": summary["grammar_mask_s"],
    }


def run_hf(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from batchrun.model_loader import resolve_model_dir

    torch.set_num_threads(os.cpu_count() or 1)
    work = Path(args.work)
    prompts = json.loads((work / "prompts.json").read_text())
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
        for i in range(0, len(texts), args.batch):
            enc = tok(texts[i : i + args.batch], return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=eos)
            new = out[:, enc["input_ids"].shape[1] :]
            for row in new.tolist():  # count up to and including eos, not the padding after it
                generated += row.index(eos) + 1 if eos in row else len(row)
    wall = time.perf_counter() - t0
    return {
        "label": args.label,
        "generated_tokens": generated,
        "gen_wall_s": wall,
        "total_wall_s": wall,
        "tokens_per_s": generated / wall,
        "peak_rss_mib": peak_rss_mib(),
    }


# ---- the driver ----------------------------------------------------------------------------------------------------
def measure(kind: str, label: str, work: Path, batch: int, max_new: int, sets=(), system=None) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--one",
        kind,
        "--label",
        label,
        "--work",
        str(work),
        "--batch",
        str(batch),
        "--max-new-tokens",
        str(max_new),
    ]
    for s in sets:
        cmd += ["--set", s]
    if system:
        cmd += ["--system", system]
    print(f"  running {label} ...", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{label} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(
        f"    {result['tokens_per_s']:.1f} generated tokens/s, peak RSS {result['peak_rss_mib']:.0f} MiB",
        flush=True,
    )
    return result


def prepare(work: Path, prompts: list[str]) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    for f in work.glob("prompts.*"):
        f.unlink()
    (work / "prompts.json").write_text(json.dumps(prompts))
    return work


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", choices=["batchrun", "hf"])
    ap.add_argument("--label", default="")
    ap.add_argument("--work", default=str(ROOT / "out" / "bench"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--system", default=None)
    ap.add_argument(
        "--quick", action="store_true", help="smaller workloads (a smoke run, not for RESULTS.md)"
    )
    ap.add_argument("--only", default="throughput,bar,preemption,sharing,logprobs,structured,replicas")
    ap.add_argument("--out", default=str(ROOT / "out" / "bench-last.json"))
    args = ap.parse_args()
    if args.one == "batchrun":
        print(json.dumps(run_batchrun(args)))
        return
    if args.one == "hf":
        print(json.dumps(run_hf(args)))
        return

    from transformers import AutoTokenizer

    from batchrun.model_loader import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    base = Path(args.work)
    only = set(args.only.split(","))
    n_main, new_main = (32, 32) if args.quick else (128, 128)
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "quick": args.quick}

    if "throughput" in only:
        print(f"throughput: {n_main} chat prompts of 20-400 tokens, max_new_tokens {new_main}, batch 32")
        work = prepare(base / "throughput", make_prompts(tok, n_main, 20, 400, seed=1))
        br = measure("batchrun", "batchrun", work, 32, new_main)
        hf = measure("hf", "hf-generate-padded", work, 32, new_main)
        wide = measure("batchrun", "batchrun-128-seqs", work, 128, new_main)
        report["throughput"] = {
            "batchrun": br,
            "hf": hf,
            "batchrun_128": wide,
            "speedup": br["tokens_per_s"] / hf["tokens_per_s"],
            "speedup_128": wide["tokens_per_s"] / hf["tokens_per_s"],
            "memory_ratio": br["peak_rss_mib"] / hf["peak_rss_mib"],
        }
        print(f"  batchrun / HF generate: {report['throughput']['speedup']:.2f}x tokens/s")

    if "bar" in only:
        print(
            "bar: 60 chat prompts of 15-450 tokens, greedy, max_new_tokens 64 (the brief's reference workload)"
        )
        work = prepare(base / "bar60", make_prompts(tok, 60, 15, 450, seed=5))
        br = measure("batchrun", "batchrun-256-seqs", work, 256, 64)
        hf16 = measure("hf", "hf-generate-padded-16", work, 16, 64)
        hf60 = measure("hf", "hf-generate-padded-60", work, 60, 64)
        report["bar"] = {
            "batchrun": br,
            "hf16": hf16,
            "hf60": hf60,
            "speedup_16": br["tokens_per_s"] / hf16["tokens_per_s"],
            "speedup_60": br["tokens_per_s"] / hf60["tokens_per_s"],
        }

    if "preemption" in only:
        n, new = (24, 32) if args.quick else (64, 64)
        print(f"preemption: {n} short prompts, max_new_tokens {new} (ignore_eos), a quarter of the pages")
        work = prepare(base / "preemption", make_prompts(tok, n, 20, 60, seed=2))
        common = ["sampling.ignore_eos=true"]
        free = measure("batchrun", "unconstrained", work, 64, new, common)
        quarter = max(free["peak_pages_used"] // 4, -(-(60 + new) // 16))
        swap = measure(
            "batchrun",
            "swap",
            work,
            64,
            new,
            [*common, f"engine.num_pages={quarter}", "engine.preemption=swap"],
        )
        rec = measure(
            "batchrun",
            "recompute",
            work,
            64,
            new,
            [*common, f"engine.num_pages={quarter}", "engine.preemption=recompute"],
        )
        report["preemption"] = {
            "unconstrained": free,
            "swap": swap,
            "recompute": rec,
            "num_pages": quarter,
            "swap_vs_free": swap["tokens_per_s"] / free["tokens_per_s"],
            "recompute_vs_free": rec["tokens_per_s"] / free["tokens_per_s"],
        }

    if "sharing" in only:
        new = 16 if args.quick else 32
        print(f"sharing: 32 rows behind a ~220-token system prompt, max_new_tokens {new}")
        system = (
            "You are the help desk of a city library. Answer visitors' questions about opening hours, "
            "membership, borrowing limits, late fees, study rooms, printing and events in one friendly "
            "sentence. " * 6
        )
        work = prepare(
            base / "sharing", [f"Question {i}: can I {WORDS[i % len(WORDS)]} in room {i}?" for i in range(32)]
        )
        on = measure("batchrun", "sharing-on", work, 32, new, ["engine.prefix_sharing=true"], system)
        off = measure("batchrun", "sharing-off", work, 32, new, ["engine.prefix_sharing=false"], system)
        report["sharing"] = {
            "on": on,
            "off": off,
            "speedup": on["tokens_per_s"] / off["tokens_per_s"],
            "peak_pages_ratio": on["peak_pages_used"] / off["peak_pages_used"],
        }

    # A/B on the reference workload: the two kinds alternate, twice each; the best run of each counts (a cold
    # first run is slow)
    ab_tests = {
        "logprobs": ("logprobs 5 vs without", ("plain", []), ("logprobs", ["sampling.logprobs=5"])),
        "structured": (
            "json_object vs free text",
            ("free", []),
            ("json_object", ['sampling.response_format={"type": "json_object"}']),
        ),
        "replicas": (
            "2 replicas of 1 thread vs 1 process of 2 threads",
            ("one", []),
            ("two", ["engine.replicas=2"]),
        ),
    }
    for key, (what, (a_name, a_sets), (b_name, b_sets)) in ab_tests.items():
        if key not in only:
            continue
        print(f"{key}: the reference workload (60 prompts, 64 new tokens), {what}")
        work = prepare(base / key, make_prompts(tok, 60, 15, 450, seed=5))
        runs: dict[str, list] = {a_name: [], b_name: []}
        for i in range(2):
            runs[a_name].append(measure("batchrun", f"{a_name}-{i}", work, 256, 64, a_sets))
            runs[b_name].append(measure("batchrun", f"{b_name}-{i}", work, 256, 64, b_sets))
        best = {k: max(x["tokens_per_s"] for x in v) for k, v in runs.items()}
        report[key] = {**runs, "ratio": best[b_name] / best[a_name]}

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(format_report(report))


def format_report(r: dict) -> str:
    lines = [f"\n== batchrun bench, {r['date']}, {r['cpus']} CPUs{' (quick)' if r['quick'] else ''} =="]
    if "throughput" in r:
        t = r["throughput"]
        lines += ["| run | generated tok/s | generated tokens | peak RSS MiB |", "|---|---|---|---|"]
        for k in ("batchrun", "hf", "batchrun_128"):
            if k not in t:
                continue
            x = t[k]
            lines.append(
                f"| {x['label']} | {x['tokens_per_s']:.1f} | {x['generated_tokens']} | "
                f"{x['peak_rss_mib']:.0f} |"
            )
        lines.append(
            f"batchrun / HF generate: **{t['speedup']:.2f}x** tokens/s, {t['memory_ratio']:.2f}x peak RSS"
        )
        if "speedup_128" in t:
            lines.append(
                f"batchrun with max_num_seqs 128 / HF generate (batch 32): {t['speedup_128']:.2f}x tokens/s"
            )
    if "bar" in r:
        b = r["bar"]
        lines += [
            "",
            "| run (60 prompts, 64 new tokens) | generated tok/s | generated tokens | peak RSS MiB |",
            "|---|---|---|---|",
        ]
        for k in ("batchrun", "hf16", "hf60"):
            x = b[k]
            lines.append(
                f"| {x['label']} | {x['tokens_per_s']:.1f} | {x['generated_tokens']} | "
                f"{x['peak_rss_mib']:.0f} |"
            )
        lines.append(
            f"batchrun / HF generate: {b['speedup_16']:.2f}x (batches of 16), "
            f"{b['speedup_60']:.2f}x (one batch of 60)"
        )
    if "preemption" in r:
        p = r["preemption"]
        lines += [
            "",
            f"| run ({p['num_pages']} pages when constrained) | tok/s | preemptions | swapped-out pages |"
            " recomputations | vs unconstrained |",
            "|---|---|---|---|---|---|",
        ]
        for k in ("unconstrained", "swap", "recompute"):
            x = p[k]
            lines.append(
                f"| {k} | {x['tokens_per_s']:.1f} | {x['preemptions']} | {x['swap_out_pages']} | "
                f"{x['recomputations']} | {x['tokens_per_s'] / p['unconstrained']['tokens_per_s']:.2f}x |"
            )
    if "sharing" in r:
        s = r["sharing"]
        lines += [
            "",
            "| run | tok/s | peak pages | prompt tokens computed | duplication saved (peak) |",
            "|---|---|---|---|---|",
        ]
        for k in ("on", "off"):
            x = s[k]
            lines.append(
                f"| prefix sharing {k} | {x['tokens_per_s']:.1f} | {x['peak_pages_used']} | "
                f"{x['prompt_tokens_computed']} | {x['duplication_saved_peak']:.1%} |"
            )
        lines.append(
            f"sharing on / off: {s['speedup']:.2f}x tokens/s, {s['peak_pages_ratio']:.2f}x peak pages"
        )
    if "logprobs" in r:
        g = r["logprobs"]
        lines += ["", "| run | tok/s | generated tokens |", "|---|---|---|"]
        for x in [*g["plain"], *g["logprobs"]]:
            lines.append(f"| {x['label']} | {x['tokens_per_s']:.1f} | {x['generated_tokens']} |")
        lines.append(f"logprobs 5 / plain: {g['ratio']:.2f}x tokens/s (best run of each)")
    if "structured" in r:
        g = r["structured"]
        lines += [
            "",
            "| run | tok/s | generated tokens | rows complete | compile ms | mask ms per step |",
            "|---|---|---|---|---|---|",
        ]
        for x in [*g["free"], *g["json_object"]]:
            lines.append(
                f"| {x['label']} | {x['tokens_per_s']:.1f} | {x['generated_tokens']} | "
                f"{x['structured_complete']}/{x['structured_rows']} | {x['grammar_compile_s'] * 1e3:.1f} | "
                f"{x['grammar_mask_s'] / x['steps'] * 1e3:.2f} |"
            )
        lines.append(f"json_object / free text: {g['ratio']:.2f}x generated tokens/s (best run of each)")
    if "replicas" in r:
        g = r["replicas"]
        lines += [
            "",
            "| run | tok/s (whole run) | generated tokens | peak RSS MiB (parent) |",
            "|---|---|---|---|",
        ]
        for x in [*g["one"], *g["two"]]:
            lines.append(
                f"| {x['label']} | {x['tokens_per_s']:.1f} | {x['generated_tokens']} | {x['peak_rss_mib']:.0f} |"
            )
        lines.append(f"2 replicas / 1 process: {g['ratio']:.2f}x generated tokens/s (best run of each)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
