"""A hybrid model: a Qwen-3.5-shaped model of random weights (3 Gated DeltaNet layers : 1 gated
attention layer) on 200 rows behind one ~500-token system prompt, side by side in one run:

1. batchrun vs HF `generate` (padded batches of 16) on the same rows, fp32, greedy: generated tokens/s of the
   whole process (the model's load included) and of the generation alone;
2. prefix sharing on the hybrid: prompt tokens computed against the prompt tokens, and the share of the system
   prompt's tokens (per row after the first) that were not computed;
3. memory: the hybrid against a pure-attention model of the same width and depth (Qwen 3, every layer
   attention) under the same KV budget: bytes per sequence at the workload's mean length, and the most
   sequences each ran at once.

Usage: python -m bench.hybrid [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from .common import (
    OUT,
    columns,
    environment,
    in_process,
    peak_rss_mib,
    random_model,
    run_batchrun,
    save,
    write_prompts,
)

MODULE = "bench.hybrid"
SYSTEM = (  # its templated length: bench/RESULTS.md
    "You are the assistant of a regional railway. Answer travellers' questions about timetables, tickets, "
    "seat reservations, bicycles on board, luggage, delays and refunds, accessibility and connections to "
    "buses and ferries in two short sentences, politely, without inventing services. "
) * 9
SHAPE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8, head_dim=64)
KV_BUDGET = "256MiB"  # small enough that memory, not max_num_seqs, bounds the sequences at once


def build(work: Path) -> dict[str, str]:
    """The hybrid and the pure-attention model, random weights, with the embedded model's tokenizer."""
    from transformers import AutoConfig

    from batchrun.model_loader import resolve_model_dir

    tokenizer = resolve_model_dir(None)
    common = dict(SHAPE, num_key_value_heads=2, vocab_size=49152, max_position_embeddings=4096)
    hybrid = AutoConfig.for_model(
        "qwen3_5_text",
        **common,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
    )
    attention = AutoConfig.for_model("qwen3", **common)
    return {
        name: str(random_model(cfg, work, name, tokenizer_from=tokenizer))
        for name, cfg in (("hybrid", hybrid), ("attention", attention))
    }


def batchrun_run(work: str, label: str, model: str, new: int, engine: dict) -> dict:
    t0 = time.perf_counter()
    sections = {
        "model": {"path": model, "dtype": "float32", "system_prompt": SYSTEM},
        "sampling": {"max_new_tokens": new, "ignore_eos": True},
        "engine": engine,
    }
    r = run_batchrun(Path(work), label, sections)
    r["process_s"] = time.perf_counter() - t0
    first, shared = r["prompt_ids"][0], len(r["prompt_ids"][0])
    for ids in r["prompt_ids"][1:]:  # the tokens every row's prompt starts with: the system turn
        shared = next(
            (i for i, (a, b) in enumerate(zip(first[:shared], ids)) if a != b), min(shared, len(ids))
        )
    r["shared_prefix_tokens"] = shared
    return {k: v for k, v in r.items() if k not in ("prompt_ids", "completions")}


def hf_run(work: str, label: str, model: str, new: int, batch: int) -> dict:
    """HF `generate`, fp32, greedy, left-padded static batches (`min_new_tokens` = max: every row generates
    `new` tokens, as batchrun's ignore_eos)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(os.cpu_count() or 1)
    t0 = time.perf_counter()
    questions = json.loads((Path(work) / "prompts.json").read_text())
    tok = AutoTokenizer.from_pretrained(model)
    tok.padding_side = "left"
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    texts = [
        tok.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for q in questions
    ]
    t1 = time.perf_counter()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    with torch.inference_mode():
        for i in range(0, len(texts), batch):
            enc = tok(texts[i : i + batch], return_tensors="pt", padding=True, add_special_tokens=False)
            lm.generate(**enc, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad)
    end = time.perf_counter()
    generated = new * len(texts)
    return dict(
        label=label,
        generated_tokens=generated,
        wall_s=end - t1,
        process_s=end - t0,
        tokens_per_s=generated / (end - t1),
        peak_rss_mib=peak_rss_mib(),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="40 rows, 8 new tokens (a smoke run)")
    ap.add_argument("--out", default=str(OUT / "hybrid.json"))
    args = ap.parse_args()
    rows, new = (40, 8) if args.quick else (200, 32)
    work = OUT / "hybrid"
    models = build(work)
    questions = [
        f"Question {i}: can I take a bicycle on the {7 + i % 12}:{i % 6}0 train to stop {i}?"
        for i in range(rows)
    ]
    write_prompts(work, questions)
    (work / "prompts.json").write_text(json.dumps(questions))
    r: dict = {**environment(), "quick": args.quick, "rows": rows, "new": new}
    print(f"hybrid: {rows} rows behind a shared system prompt, {new} new tokens each")
    engine = {"max_num_seqs": 64}
    ours = in_process(
        MODULE,
        "batchrun_run",
        work=str(work),
        label="batchrun",
        model=models["hybrid"],
        new=new,
        engine=engine,
    )
    theirs = in_process(
        MODULE, "hf_run", work=str(work), label="hf-generate-16", model=models["hybrid"], new=new, batch=16
    )
    bounded = {**engine, "kv_cache_memory": KV_BUDGET}
    mem = {
        name: in_process(
            MODULE,
            "batchrun_run",
            work=str(work),
            label=f"{name}-{KV_BUDGET}",
            model=path,
            new=new,
            engine=bounded,
        )
        for name, path in models.items()
    }
    for x in (ours, theirs, *mem.values()):
        x["process_tokens_per_s"] = x["generated_tokens"] / x["process_s"]
    per_row = ours["prompt_tokens"] / rows
    for x in mem.values():
        x["bytes_per_sequence"] = (
            x["bytes_per_state_slot"] + x["bytes_per_page"] * (per_row + new) / x["page_size"]
        )
    r.update(batchrun=ours, hf=theirs, memory=mem)
    lines = [
        f"\n== hybrid (Qwen 3.5 shape, {SHAPE['num_hidden_layers']} layers) vs HF generate, {r['date']}, {r['cpu']}, {r['cpus']} CPUs{' (quick)' * args.quick} =="
    ]
    spec = {
        "run": "{label}",
        "generated tok/s": "{tokens_per_s:.1f}",
        "whole process tok/s": "{process_tokens_per_s:.1f}",
        "process s": "{process_s:.1f}",
        "peak RSS MiB": "{peak_rss_mib:.0f}",
    }
    lines += ["", *columns(spec, [ours, theirs])]
    lines.append(
        f"batchrun / HF generate, whole process: **{ours['process_tokens_per_s'] / theirs['process_tokens_per_s']:.2f}x**; generation alone: **{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x**"
    )
    shareable = ours["shared_prefix_tokens"] * (rows - 1)  # the system turn, in every row after the first
    r["shared_prefix_saved"] = ours["prefix_hit_tokens"] / shareable if shareable else 0.0
    lines.append(
        f"prefix sharing: {ours['prompt_tokens_computed']} of {ours['prompt_tokens']} prompt tokens computed; "
        f"{ours['prefix_hit_tokens']} not computed (shared pages and a kept state) = "
        f"**{r['shared_prefix_saved']:.1%}** of the {ours['shared_prefix_tokens']}-token shared prefix in the "
        f"{rows - 1} rows after the first"
    )
    mem_spec = {
        f"model ({KV_BUDGET} KV budget)": "{label}",
        "state slots": "{state_slots_total}",
        "bytes per state slot": "{bytes_per_state_slot}",
        "bytes per page": "{bytes_per_page}",
        "bytes per sequence (mean length)": "{bytes_per_sequence:.0f}",
        "pages": "{pages_total}",
        "peak sequences at once": "{peak_running}",
        "generated tok/s": "{tokens_per_s:.1f}",
    }
    lines += ["", *columns(mem_spec, list(mem.values()))]
    save(r, Path(args.out), "\n".join(lines))


if __name__ == "__main__":
    from .common import serve_one

    if not serve_one({"batchrun_run": batchrun_run, "hf_run": hf_run}):
        main()
