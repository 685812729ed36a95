"""A decode step's host work in thread CPU time, phase by phase: bench/host.py's engine and workload, each step's
phases read from the engine's own timers with their clock switched to `time.thread_time`, medians over steps.

  OMP_NUM_THREADS=1 nice -n 19 python -m bench.micro.host_phases                 1, 64 and 256 sequences
  OMP_NUM_THREADS=1 nice -n 19 python -m bench.micro.host_phases --seqs 256 --profile 30   and a cProfile

Thread CPU time counts this thread's own work only, so the figures hold on a machine other work shares (wall
clock does not): with one OpenMP thread every operation runs on it. Medians over the run's steps after the
first (the prompts), so the figures are a decode step's. "bookkeeping" is schedule + prepare + sample + finish +
stats, as bench/host.py sums it; "forward - attention" is the model's own modules and HF's Python around them.
"""

from __future__ import annotations

import argparse
import statistics
import time

PHASES = ("schedule", "prepare", "forward", "attention", "sample", "finish", "stats")


def measure(n: int, repeat: int = 2, profile: int = 0, sort: str = "tottime") -> dict[str, float]:
    """Median thread-CPU milliseconds of each phase over the decode steps of `repeat` runs of n sequences
    (one warm-up run first); `profile` > 0 prints cProfile's top functions of the last run, by `sort`."""
    import cProfile
    import pstats

    from batchrun.engine import SamplingParams
    from batchrun.stats import StatsCollector

    from ..host import NEW_TOKENS, make_engine, prompts, save_model, tiny_config

    time.perf_counter = time.thread_time  # the engine's phase timers read this clock
    engine = make_engine(save_model(tiny_config(), "tiny-llama"), max(n, 1))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    stats = StatsCollector(engine)
    seconds = engine.times.seconds
    per_step: dict[str, list[float]] = {p: [] for p in PHASES}

    def run(record: bool) -> None:
        for p in prompts(n, 512):
            engine.add(p, params)
        first = True
        while engine.has_unfinished():
            before = dict(seconds)
            result = engine.step()
            with engine.times("stats"):
                stats.record(result)
            if record and not first:
                for p in PHASES:
                    per_step[p].append(seconds[p] - before[p])
            first = False

    run(False)  # warm-up
    for _ in range(repeat - 1 if profile else repeat):
        run(True)
    if profile:
        prof = cProfile.Profile(time.thread_time)
        prof.enable()
        run(True)
        prof.disable()
        pstats.Stats(prof).sort_stats(sort).print_stats(profile)
    ms = {p: 1e3 * statistics.median(v) for p, v in per_step.items()}
    ms["bookkeeping"] = sum(ms[p] for p in ("schedule", "prepare", "sample", "finish", "stats"))
    ms["step"] = ms["bookkeeping"] + ms["forward"]
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="1,64,256")
    parser.add_argument("--repeat", type=int, default=2, help="measured runs of 128 steps each")
    parser.add_argument(
        "--profile", type=int, default=0, help="print cProfile's top N functions (by own time)"
    )
    parser.add_argument("--sort", default="tottime", help="the profile's order (cumulative: with callees)")
    args = parser.parse_args()
    cols = [*PHASES, "bookkeeping", "step"]
    print("seqs | " + " | ".join(cols) + "   (thread CPU ms per decode step, medians)")
    for n in [int(s) for s in args.seqs.split(",")]:
        ms = measure(n, args.repeat, args.profile, args.sort)
        print(f"{n} | " + " | ".join(f"{ms[c]:.3f}" for c in cols), flush=True)


if __name__ == "__main__":
    main()
