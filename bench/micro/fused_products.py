"""The embedded SmolLM2-135M's forward (HF's own code, SDPA attention, the base model without its LM head) with its
linear layers packed for oneDNN one by one and with q/k/v and gate/up fused into one packed product each
(engine/model/ops/fused_linear.py), in one process, interleaved, in one thread, timed in the process's CPU time (best and
median of 6; bench/RESULTS.md, issue 50). On a machine shared with other jobs a thread's CPU time is the work it
did, whoever else runs; the wall clock of a whole run is not. Also checks that both give the same hidden states.

Usage: OMP_NUM_THREADS=1 python -m bench.micro.fused_products
"""

from __future__ import annotations

import copy
import os
import time

import torch

from batchrun.engine.model.ops.cpu_linear import pack_linear_layers
from batchrun.model_loader import resolve_model_dir

ROWS = (60, 512)  # a decode step of the reference workload's 60 rows; a prefill chunk


def main() -> None:
    from transformers import AutoModelForCausalLM

    print(f"threads: {torch.get_num_threads()} (set OMP_NUM_THREADS=1 for CPU time to be the work)")
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(None), dtype=dtype).eval().model
        apart, fused = copy.deepcopy(model), copy.deepcopy(model)
        pack_linear_layers(apart, fuse=False)
        pack_linear_layers(fused)
        for rows in ROWS:
            ids = torch.randint(3, 40000, (1, rows), generator=torch.Generator().manual_seed(0))
            times: dict[str, list[float]] = {"apart": [], "fused": []}
            with torch.inference_mode():
                same = torch.equal(apart(ids).last_hidden_state, fused(ids).last_hidden_state)
                for i in range(6):  # alternated, so that a change of load falls on both
                    order = [("apart", apart), ("fused", fused)]
                    for name, m in order if i % 2 == 0 else order[::-1]:
                        t0 = time.process_time()
                        m(ids)
                        times[name].append(time.process_time() - t0)
            best = {k: min(v) * 1e3 for k, v in times.items()}
            median = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
            print(
                f"{str(dtype)[6:]:9s} {rows:4d} tokens, CPU ms best/median: apart {best['apart']:.1f}/"
                f"{median['apart']:.1f}, fused {best['fused']:.1f}/{median['fused']:.1f}, "
                f"apart/fused {best['apart'] / best['fused']:.3f}; hidden states equal: {same}; "
                f"load {os.getloadavg()[0]:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
