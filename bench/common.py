"""What the benchmarks share: the workloads, one way to run batchrun on them, timers, a measurement in a process
of its own, random-weight models, and Markdown tables. The benchmarks are modules run from the repository root:

  python -m bench.vs_hf        batchrun against Hugging Face `generate` (and swap, sharing, logprobs, ...)
  python -m bench.vs_vllm      batchrun against vLLM's CPU build, and where a step's time goes
  bash bench/gpu_check.sh      the GPU check (bench/gpu_bench.py), on the accelerator machine
  python -m bench.micro.profile_step   profiles through the engine's own timers

What they write goes under out/; the figures that matter go into bench/RESULTS.md with the date and the CPU.
"""

from __future__ import annotations

import json
import os
import random
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "out" / "bench"
# SmolLM2-135M's shape (its config.json but rope_theta, which bench/host.py adds; bench/quant.py starts from the
# embedded model's config, which has it): every dimension a multiple of 64, which FP8's blocks and bitsandbytes'
# need (compressed-tensors' W4A16 groups of 128 do not divide 576: W8A8 stands for it)
SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    initializer_range=0.02,
)
WORDS = (
    "river stone paper light window garden music number planet engine silver forest market winter bridge "
    "letter signal harbor candle mirror ladder basket circle thunder meadow lantern orchard copper valley"
).split()
ASKS = (
    "Summarise the notes above in two sentences.",
    "What do these words have in common?",
    "Write a short poem using some of these words.",
    "Explain the list above to a child.",
    "Pick three words above and tell a tiny story.",
)


# ---- workloads -----------------------------------------------------------------------------------------------
def chat_prompts(tok, n: int, lo: int, hi: int, seed: int = 0) -> list[str]:
    """Chat prompts whose templated length is roughly uniform in [lo, hi] tokens."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        target, ask, words = rng.randint(lo, hi), rng.choice(ASKS), []
        while True:
            text = (" ".join(words) + "\n" + ask).strip()
            if len(chat_ids(tok, [text])[0]) >= target:
                break
            words += rng.sample(WORDS, 8)
        prompts.append(text)
    return prompts


def reference_prompts(seed: int = 11) -> list[str]:
    """The vLLM comparison's workload: 30 questions behind one ~330-token shared context, interleaved with 30
    prompts of 20-130 words of their own (so sharing is not just admission order)."""
    rng = random.Random(seed)
    context = "Notes from the archive: " + " ".join(rng.choice(WORDS) for _ in range(300))
    shared = [f"{context}\n\nQuestion {i}: {rng.choice(ASKS)}" for i in range(30)]
    own = [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 130))) + "\n" + rng.choice(ASKS)
        for _ in range(30)
    ]
    return [p for pair in zip(shared, own) for p in pair]


def chat_ids(tok, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt as one user turn through the chat template (what a job file's string prompt is)."""
    render = lambda p: tok.apply_chat_template(
        [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
    )  # noqa: E731
    return [tok(render(p), add_special_tokens=False)["input_ids"] for p in prompts]


def write_prompts(work: Path, prompts: list[str]) -> Path:
    """prompts.parquet (id, prompt) in `work`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    work.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": list(range(len(prompts))), "prompt": prompts}), work / "prompts.parquet")
    return work / "prompts.parquet"


# ---- batchrun on a workload ----------------------------------------------------------------------------------
def run_batchrun(work: Path, label: str, sections: dict[str, dict]) -> dict:
    """One job on `work`/prompts.parquet through the Python API (`batchrun.run_job`), written to out-<label>;
    `sections`: the job file's sections to set (engine, sampling, model, ...). Returns the job's summary with
    `tokens_per_s` (generated tokens over the run's wall time, tokenizing and writing included), this process's
    peak RSS and every row's token ids."""
    import pyarrow.parquet as pq

    from batchrun import run_job

    out = work / f"out-{label}"
    job: dict[str, Any] = {
        "name": f"bench-{label}",
        "input": {"parquet": str(work / "prompts.parquet"), "id_column": "id"},
        "output": {"path": str(out), "token_ids": True},
    }
    for section, values in sections.items():
        job[section] = {**job.get(section, {}), **values}
    summary = run_job(job, overwrite=True, progress=False)
    rows = sorted(
        pq.read_table(out, columns=["id", "prompt_token_ids", "completion_token_ids"]).to_pylist(),
        key=lambda r: r["id"],
    )
    return {
        **summary,
        "label": label,
        "tokens_per_s": summary["generated_tokens"] / summary["wall_s"],
        "peak_rss_mib": peak_rss_mib(),
        "prompt_ids": [r["prompt_token_ids"] for r in rows],
        "completions": [r["completion_token_ids"] for r in rows],
    }


# ---- vLLM, the peer -----------------------------------------------------------------------------------------
# vLLM's CPU build, in a virtual environment of its own, never batchrun's (bench/vs_vllm.py says how to make it)
VLLM_PYTHON = Path(os.environ.get("VLLM_PYTHON", "/tmp/vllm-venv/bin/python"))


def run_vllm_peer(script: str, args: list, kv_cache_gib: int = 4) -> subprocess.CompletedProcess:
    """bench/`script` with `args` in vLLM's environment, on both cores (its default keeps one for its scheduler)
    with `kv_cache_gib` of KV cache; the finished process (its output captured), whatever its exit status."""
    env = dict(
        os.environ,
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        TOKENIZERS_PARALLELISM="false",
    )
    cmd = [str(VLLM_PYTHON), str(ROOT / "bench" / script), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)


# ---- measuring -----------------------------------------------------------------------------------------------
def best_seconds(
    fn: Callable[[], Any], repeat: int = 5, clock: Callable[[], float] = time.perf_counter
) -> float:
    """The best of `repeat` calls (after one warm-up call), in seconds of `clock` (time.thread_time: the CPU time
    of this thread alone, which other processes on the machine do not inflate, for work run in one thread)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # ru_maxrss is in KiB on Linux


def in_process(module: str, function: str, **kwargs) -> dict:
    """`module.function(**kwargs)` in a fresh Python process (its peak memory and start are its own); returns
    what it returned (JSON). The module serves it with `serve_one()`."""
    call = json.dumps({"function": function, "kwargs": kwargs}, default=str)
    cmd = [sys.executable, "-m", module, "--one", call]
    print(f"  running {kwargs.get('label', function)} ...", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{module}.{function}({kwargs.get('label', '')}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def serve_one(functions: dict[str, Callable[..., dict]]) -> bool:
    """In a process `in_process` started: run the function it asked for, print its result; True if so."""
    if len(sys.argv) != 3 or sys.argv[1] != "--one":
        return False
    call = json.loads(sys.argv[2])
    print(json.dumps(functions[call["function"]](**call["kwargs"])))
    return True


def random_model(
    config, work: Path, name: str, tokenizer_from: Path | None = None, dtype=None, device: str = "cpu"
) -> Path:
    """A model of `config` with random weights (seed 0, made on `device`), saved under `work`/`name` with a
    tokenizer's files."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config).to(dtype)  # .to(None) keeps the config's dtype
    target = work / name
    model.save_pretrained(target)
    if tokenizer_from is not None:
        AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(target)
    return target


# ---- reporting -----------------------------------------------------------------------------------------------
def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    """A Markdown table; floats with one decimal unless already formatted."""
    cell = lambda v: f"{v:.1f}" if isinstance(v, float) else str(v)  # noqa: E731
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(cell(v) for v in row) + " |" for row in rows),
    ]


def columns(spec: dict[str, str], items: list[dict]) -> list[str]:
    """A Markdown table of dicts: `spec` maps each header to a format string of an item's keys."""
    return table(list(spec), [[fmt.format(**x) for fmt in spec.values()] for x in items])


def save(report: dict, path: Path, text: str) -> None:
    """The report as JSON at `path` (under out/) and its text on stdout."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(text)


def environment() -> dict:
    """The date, the CPU count and the CPU: its name and features, and the kernels oneDNN picks on it for the
    packed fp32 and bf16 products (an AMX CPU shows `avx512_core_amx` there), so every figure names them."""
    from batchrun.host import cpu_name

    kernels = onednn_kernels()
    cpu = cpu_name() + (
        "; oneDNN " + ", ".join(f"{dtype} {impl}" for dtype, impl in kernels.items()) if kernels else ""
    )
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "cpu": cpu, "onednn": kernels}


ONEDNN_PROBE = """
import torch
for dtype in (torch.float32, torch.bfloat16):
    w, x = torch.randn(64, 64, dtype=dtype), torch.randn(8, 64, dtype=dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError:
        pass  # no packed bf16 on this CPU: nothing printed for it
"""


def onednn_kernels() -> dict[str, str]:
    """{"fp32": implementation, "bf16": ...} of oneDNN's packed linear product on this CPU, as its verbose mode
    names them (brg_matmul:avx512_core_amx, brg_matmul:avx512_core_bf16, ...); {} where it cannot tell."""
    env = {**os.environ, "ONEDNN_VERBOSE": "1", "OMP_NUM_THREADS": "1"}
    try:
        r = subprocess.run(
            [sys.executable, "-c", ONEDNN_PROBE], capture_output=True, text=True, timeout=120, env=env
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found = {}
    for (
        line
    ) in r.stdout.splitlines():  # onednn_verbose,v1,primitive,exec,cpu,inner_product,IMPL,...,src:f32::...
        fields = line.split(",")
        if "inner_product" in fields and len(fields) > 9:
            impl = fields[fields.index("inner_product") + 1]
            src = next((f for f in fields if f.startswith("src:")), "")
            found["bf16" if src.startswith("src:bf16") else "fp32"] = impl
    return found
