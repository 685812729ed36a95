"""Where batchrun's time goes, by profiler, on bench/speed.py's reference workload (one process, the API):

  python bench/profile_step.py run [--dtype float32] [--sharing off]   torch.profiler over the whole batch, with
      the attention split into K/V writes, the C++ decode and the prompts' SDPA; the top operators by self time
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


def profile_run(dtype: str, sharing: str) -> None:
    import torch
    from speed import MAX_NEW, reference_prompts
    from torch.profiler import ProfilerActivity, profile, record_function

    import batchrun.engine.attention as attention
    from batchrun import LLM, SamplingParams

    llm = LLM(dtype=dtype, device="cpu", prefix_sharing=sharing == "on")
    assert llm.engine.attention.name == "torch", "the C++ decode kernel did not build"
    convs = [[{"role": "user", "content": p}] for p in reference_prompts()]
    llm.chat(convs[:2], SamplingParams(max_new_tokens=2), use_tqdm=False)  # warm-up

    def forward(self, meta, q, k, v, k_cache, v_cache, scale):  # TorchAttention.forward, with labels
        plan = meta.plan
        with record_function("## write K/V"):
            attention.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        if plan.decode is not None:
            d = plan.decode
            with record_function("## C++ decode"):
                self.kernel.paged_decode_attention(
                    out, q, k_cache, v_cache, d.block_tables, d.seq_lens, d.token_index, scale
                )
        with record_function("## prompts' SDPA"):
            attention.prefill_attention(out, q, k, v, k_cache, v_cache, plan.prefills, scale)
        return out

    attention.TorchAttention.forward = forward
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        outs = llm.chat(convs, SamplingParams(max_new_tokens=MAX_NEW), use_tqdm=False)
        wall = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{dtype}, sharing {sharing}: {wall:.1f} s under the profiler, {generated} tokens generated")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


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
    ap.add_argument("what", choices=["run", "startup"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--sharing", default="off")
    args = ap.parse_args()
    profile_run(args.dtype, args.sharing) if args.what == "run" else profile_startup()


if __name__ == "__main__":
    main()
