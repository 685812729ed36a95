"""`make bench`, first half: batchrun against Hugging Face `generate`, and batchrun against itself with a feature
on and off, side by side in one run, reported as ratios. Each measurement runs in its own process (its peak
memory is its own), fp32, greedy, on the same prompts:

1. throughput: >=128 chat prompts of 20-400 tokens, 128 new tokens, eos allowed: batchrun vs HF `generate` with
   padded static batches of the same batch size (and batchrun at 128 sequences);
2. bar: 60 chat prompts of 15-450 tokens, 64 new tokens: batchrun vs HF `generate` in batches of 16 and of 60;
3. preemption: 64 short prompts generating 64 tokens each with a quarter of the KV pages they peak at: swap vs
   recompute vs unconstrained;
4-7. feature off vs on, alternated, twice each (the best run of each counts: a cold first run is slow): prefix
   sharing on 32 rows behind a common ~220-token system prompt; on the bar's workload, logprobs 5 vs none,
   json_object vs free text, 2 replicas of 1 thread vs 1 process of 2 threads.

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


def batchrun_run(work: str, label: str, batch: int, new: int, extra: dict | None = None) -> dict:
    """One batchrun run (in its own process): fp32 like HF generate here, max_num_seqs = the batch size;
    `extra`: job file sections' keys to set on top."""
    sections = {
        "model": {"dtype": "float32"},
        "sampling": {"max_new_tokens": new},
        "engine": {"max_num_seqs": batch},
    }
    for section, values in (extra or {}).items():
        sections[section] = {**sections.get(section, {}), **values}
    r = run_batchrun(Path(work), label, sections)
    return {k: v for k, v in r.items() if k not in ("prompt_ids", "completions")}


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
    return dict(label=label, generated_tokens=generated, wall_s=wall, tokens_per_s=generated / wall) | dict(
        peak_rss_mib=peak_rss_mib()
    )


def prepare(work: Path, prompts: list[str]) -> str:
    write_prompts(work, prompts)
    (work / "prompts.json").write_text(json.dumps(prompts))
    return str(work)


def ours(work, label, batch, new, extra=None) -> dict:
    r = in_process(MODULE, "batchrun_run", work=work, label=label, batch=batch, new=new, extra=extra)
    print(f"    {r['tokens_per_s']:.1f} generated tokens/s, peak RSS {r['peak_rss_mib']:.0f} MiB", flush=True)
    return r


def theirs(work, label, batch, new) -> dict:
    return in_process(MODULE, "hf_run", work=work, label=label, batch=batch, new=new)


LIBRARY = (  # the sharing workload's system prompt, ~220 tokens
    "You are the help desk of a city library. Answer visitors' questions about opening hours, membership, "
    "borrowing limits, late fees, study rooms, printing and events in one friendly sentence. "
) * 6
SHARING_COLUMNS = {
    "peak pages": "{peak_pages_used}",
    "prompt tokens computed": "{prompt_tokens_computed}",
    "duplication saved (peak)": "{duplication_saved_peak:.1%}",
}
STRUCTURED_COLUMNS = {
    "rows complete": "{structured_complete}/{structured_rows}",
    "compile s": "{grammar_compile_s:.3f}",
    "mask s": "{grammar_mask_s:.2f}",
}
AB_TESTS = {  # a feature off (a) and on (b): what, a, a's sections, b, b's sections, more columns
    "sharing": ("sharing on vs off", "off", {"engine": {"prefix_sharing": False}}, "on", {}, SHARING_COLUMNS),
    "logprobs": ("logprobs 5 vs without", "plain", {}, "logprobs", {"sampling": {"logprobs": 5}}, {}),
    "structured": (
        "json_object vs free text",
        "free",
        {},
        "json_object",
        {"sampling": {"response_format": {"type": "json_object"}}},
        STRUCTURED_COLUMNS,
    ),
    "replicas": (
        "2 replicas of 1 thread vs 1 process of 2 threads",
        "one",
        {},
        "two",
        {"engine": {"replicas": 2}},
        {},
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

    hf_comparisons = {  # workload: (prompts, lengths, seed, new tokens, batchrun's batch sizes, HF's batch sizes)
        "throughput": (n_main, (20, 400), 1, new_main, (32, 128), (32,)),
        "bar": (60, (15, 450), 5, 64, (256,), (16, 60)),
    }
    for key, (n, (lo, hi), seed, new, our_batches, hf_batches) in hf_comparisons.items():
        if key not in only:
            continue
        print(f"{key}: {n} chat prompts of {lo}-{hi} tokens, max_new_tokens {new}")
        work = prepare(OUT / key, chat_prompts(tok, n, lo, hi, seed=seed))
        mine = [ours(work, f"batchrun-{b}-seqs", b, new) for b in our_batches]
        hf = [theirs(work, f"hf-generate-padded-{b}", b, new) for b in hf_batches]
        ratios = {
            f"{x['label']} / {h['label']}": x["tokens_per_s"] / h["tokens_per_s"] for x in mine for h in hf
        }
        ratios["peak RSS, first of each"] = mine[0]["peak_rss_mib"] / hf[0]["peak_rss_mib"]
        r[key] = {"batchrun": mine, "hf": hf, "ratios": ratios}
        lines += ["", *columns(runs_spec, mine + hf)]
        lines += [f"{k}: **{v:.2f}x**" for k, v in ratios.items()]

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

    for key, (what, a, a_extra, b, b_extra, more_columns) in AB_TESTS.items():
        if key not in only:
            continue
        if key == "sharing":  # 32 rows behind one system prompt
            questions = [f"Question {i}: can I {WORDS[i % len(WORDS)]} in room {i}?" for i in range(32)]
            work, batch, new = prepare(OUT / key, questions), 32, 16 if args.quick else 32
            a_extra, b_extra = ({**x, "model": {"system_prompt": LIBRARY}} for x in (a_extra, b_extra))
        else:  # the bar's workload
            work, batch, new = prepare(OUT / key, chat_prompts(tok, 60, 15, 450, seed=5)), 256, 64
        print(f"{key}: {what}, max_new_tokens {new}, alternated, twice each")
        runs: dict[str, list] = {a: [], b: []}
        for i in range(2):
            runs[a].append(ours(work, f"{a}-{i}", batch, new, a_extra))
            runs[b].append(ours(work, f"{b}-{i}", batch, new, b_extra))
        best = {k: max(x["tokens_per_s"] for x in v) for k, v in runs.items()}
        r[key] = {**runs, "ratio": best[b] / best[a]}
        lines += ["", *columns({**runs_spec, **more_columns}, runs[a] + runs[b])]
        lines.append(f"{b} / {a}: {r[key]['ratio']:.2f}x generated tokens/s (best run of each)")

    save(r, Path(args.out), "\n".join(lines))


if __name__ == "__main__":
    from .common import serve_one

    if not serve_one({"batchrun_run": batchrun_run, "hf_run": hf_run}):
        main()
