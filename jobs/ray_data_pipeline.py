"""batchrun as one step of a Ray Data pipeline: read Parquet, generate, write Parquet.

    python jobs/ray_data_pipeline.py JOB.yaml INPUT OUTPUT [--address auto] [--actors 2] [--batch-size 16]

JOB.yaml's model:, engine:, sampling: and input: (the prompt, id and sampling columns) say what runs; INPUT and
OUTPUT are any paths Ray Data reads and writes (a local folder, s3://...). Without --address a Ray cluster of
this machine is started. At the end it prints each actor's engine time and how much of it the engine waited for
rows between batches (batchrun.ray.Processor.report), from the reports the actors write beside OUTPUT.

    python jobs/ray_data_pipeline.py jobs/demo.yaml jobs/data/demo.parquet out/ray-demo
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import ray

from batchrun.ray import Processor


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("job")
    ap.add_argument("input")
    ap.add_argument("output")
    ap.add_argument(
        "--address", default=None, help="a running cluster (auto, ray://HOST:PORT); default: start one"
    )
    ap.add_argument("--actors", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--one-batch-at-a-time", action="store_true", help="no overlap of batches (to compare)")
    args = ap.parse_args()
    # Ray's workers do not run in this folder: local paths made absolute
    where = lambda p: p if "://" in p else str(Path(p).resolve())  # noqa: E731
    reports = Path(tempfile.mkdtemp(prefix="batchrun-processor-"))
    ray.init(address=args.address, logging_level="WARNING")
    t0 = time.perf_counter()
    ds = ray.data.read_parquet(where(args.input))
    done = ds.map_batches(
        Processor,
        fn_constructor_kwargs={
            "job": where(args.job),
            "report_dir": str(reports),
            "overlap": not args.one_batch_at_a_time,
        },
        compute=ray.data.ActorPoolStrategy(size=args.actors),  # one engine per actor, kept across batches
        batch_size=args.batch_size,
        batch_format="pyarrow",
    )
    done.write_parquet(where(args.output))
    wall = time.perf_counter() - t0
    print(f"pipeline: {wall:.1f} s, written to {args.output}")
    for f in sorted(reports.glob("*.json")):
        r = json.loads(f.read_text())
        print(
            f"{f.stem}: {r['batches']} batches, {r['rows']} rows; engine span {r['span_s']:.2f} s, idle between "
            f"batches {r['idle_s']:.2f} s ({r['idle_s'] / max(r['span_s'], 1e-9):.1%}), {r['steps']} steps, "
            f"{r['mean_running']:.1f} sequences running a step on average"
        )
    ray.shutdown()


if __name__ == "__main__":
    main()
