"""Where batchrun's time goes on bench/speed.py's reference workload (one process, the API):

  python bench/profile_step.py run [--dtype float32] [--sharing off]   torch.profiler over the whole batch, with
      the attention split into K/V writes, the C++ decode and the prompts' SDPA; the top operators by self time
  python bench/profile_step.py attention [--dtype ...] [--sharing ...]  the same three parts of the attention
      timed by the clock, without a profiler: K/V writes in steps with prompts and in decode-only steps, the
      C++ decode (and the K/V bytes it read per second), the prompts' SDPA, and the batch's wall time
  python bench/profile_step.py startup                                  cProfile of `LLM()` after timing the
      torch and transformers imports

The figures in bench/RESULTS.md's "why 1.5x is out of reach" and start-up paragraphs come from these.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def reference_run(dtype: str, sharing: str, section):
    """An LLM on the reference workload whose attention runs its three parts inside `section(name)`; returns
    a function that generates the whole batch: (wall seconds, tokens generated)."""
    import torch
    from speed import MAX_NEW, reference_prompts

    import batchrun.engine.attention as attention
    from batchrun import LLM, SamplingParams

    llm = LLM(dtype=dtype, device="cpu", prefix_sharing=sharing == "on")
    assert llm.engine.attention.name == "torch", "the C++ decode kernel did not build"
    convs = [[{"role": "user", "content": p}] for p in reference_prompts()]
    llm.chat(convs[:2], SamplingParams(max_new_tokens=2), use_tqdm=False)  # warm-up

    def forward(self, meta, q, k, v, k_cache, v_cache, scale):  # TorchAttention.forward, in sections
        plan = meta.plan
        with section("write K/V", meta, k_cache):
            attention.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        if plan.decode is not None:
            d = plan.decode
            with section("C++ decode", meta, k_cache):
                self.kernel.paged_decode_attention(
                    out, q, k_cache, v_cache, d.block_tables, d.seq_lens, d.token_index, scale
                )
        with section("prompts' SDPA", meta, k_cache):
            attention.prefill_attention(out, q, k, v, k_cache, v_cache, plan.prefills, scale)
        return out

    attention.TorchAttention.forward = forward

    def generate() -> tuple[float, int]:
        t0 = time.perf_counter()
        outs = llm.chat(convs, SamplingParams(max_new_tokens=MAX_NEW), use_tqdm=False)
        return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)

    return generate


def profile_run(dtype: str, sharing: str) -> None:
    from torch.profiler import ProfilerActivity, profile, record_function

    generate = reference_run(dtype, sharing, lambda name, meta, k_cache: record_function(f"## {name}"))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall, generated = generate()
    print(f"{dtype}, sharing {sharing}: {wall:.1f} s under the profiler, {generated} tokens generated")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def time_attention(dtype: str, sharing: str) -> None:
    from collections import defaultdict
    from contextlib import contextmanager

    seconds: dict[str, float] = defaultdict(float)
    decode_bytes = 0

    @contextmanager
    def section(name, meta, k_cache):
        nonlocal decode_bytes
        if name == "write K/V":
            name += ", steps with prompts" if meta.plan.prefills else ", decode-only steps"
        if name == "C++ decode":  # the K/V it reads: every decoding sequence's context, keys and values
            decode_bytes += int(meta.plan.decode.seq_lens.sum()) * k_cache[0, 0].nbytes * 2
        t0 = time.perf_counter()
        yield
        seconds[name] += time.perf_counter() - t0

    wall, generated = reference_run(dtype, sharing, section)()
    parts = ", ".join(f"{name} {s:.2f} s" for name, s in seconds.items())
    rate = decode_bytes / seconds["C++ decode"] / 1e9
    print(
        f"{dtype}, sharing {sharing}: {generated} tokens in {wall:.1f} s; {parts}; the decode read {rate:.1f} GB/s"
    )


def profile_startup() -> None:
    import cProfile
    import pstats

    t0 = time.perf_counter()
    import torch  # noqa: F401

    t1 = time.perf_counter()
    import transformers  # noqa: F401

    from batchrun import LLM

    t2 = time.perf_counter()
    prof = cProfile.Profile()
    prof.enable()
    LLM(device="cpu")
    prof.disable()
    t3 = time.perf_counter()
    print(f"import torch {t1 - t0:.2f} s, transformers + batchrun {t2 - t1:.2f} s, LLM() {t3 - t2:.2f} s")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["run", "attention", "startup"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--sharing", default="off")
    args = ap.parse_args()
    if args.what == "run":
        profile_run(args.dtype, args.sharing)
    elif args.what == "attention":
        time_attention(args.dtype, args.sharing)
    else:
        profile_startup()


if __name__ == "__main__":
    main()
