"""Where batchrun's time goes on bench/vs_vllm.py's reference workload (one process, the API):

  python -m bench.micro.profile_step attention [--dtype ...] [--sharing ...]  the attention's parts as the engine times
      them (PhaseTimes.parts): K/V writes in steps with prompts and in decode-only steps, the C++ decode (and the
      K/V bytes it read per second), the prompts' attention, and the batch's wall time
  python -m bench.micro.profile_step startup                                  cProfile of `LLM()` after timing the
      torch and transformers imports

The figures in bench/RESULTS.md's "why 1.5x is out of reach" and start-up paragraphs come from these.
"""

from __future__ import annotations

import argparse
import time

from ..common import reference_prompts
from ..vs_vllm import MAX_NEW


def reference_run(dtype: str, sharing: str):
    """An LLM on the reference workload; returns it and a function that generates the whole batch: (wall
    seconds, tokens generated). The attention's parts are timed by the engine itself (TorchAttention.forward's
    `times.part`)."""
    from batchrun import LLM, SamplingParams

    llm = LLM(dtype=dtype, device="cpu", prefix_sharing=sharing == "on")
    assert llm.engine.attention.name == "torch", "the C++ decode kernel did not build"
    convs = [[{"role": "user", "content": p}] for p in reference_prompts()]
    llm.chat(convs[:2], SamplingParams(max_new_tokens=2), use_tqdm=False)  # warm-up

    def generate() -> tuple[float, int]:
        t0 = time.perf_counter()
        outs = llm.chat(convs, SamplingParams(max_new_tokens=MAX_NEW), use_tqdm=False)
        return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)

    return llm, generate


def time_attention(dtype: str, sharing: str) -> None:
    llm, generate = reference_run(dtype, sharing)
    times = llm.engine.times
    times.detailed = True
    times.parts.clear()
    times.counts.clear()
    wall, generated = generate()
    parts = ", ".join(f"{name} {s:.2f} s" for name, s in times.parts.items())
    rate = (
        times.counts.get("C++ decode: K/V bytes read", 0) / times.parts.get("C++ decode", float("inf")) / 1e9
    )
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
    ap.add_argument("what", choices=["attention", "startup"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--sharing", default="off")
    args = ap.parse_args()
    if args.what == "attention":
        time_attention(args.dtype, args.sharing)
    else:
        profile_startup()


if __name__ == "__main__":
    main()
