"""SmolLM2-135M's RMSNorm and SiLU-and-mul at a prefill step's rows, three ways, in one thread's CPU time (issue 50):
HF's module as written, batchrun's C++ kernel (engine/model/ops/fused_elementwise.py), and HF's module compiled by
torch.compile (inductor, dynamic shapes: a step's row count changes every step). Alternated, best/median of
`--repeat`; the compile's own time is printed apart. Each way's output is compared with HF's (values bit-equal).

Usage: OMP_NUM_THREADS=1 python -m bench.micro.elementwise_ops [--dtype bfloat16] [--rows 2048] [--repeat 7]
"""

from __future__ import annotations

import argparse
import time

import torch

from batchrun.engine.cpu_kernels import load
from batchrun.engine.model.ops.fused_elementwise import FusedRMSNorm

HIDDEN, INTERMEDIATE, EPS = 576, 1536, 1e-5  # SmolLM2-135M


def cpu_ms(fn, *args) -> float:
    t0 = time.thread_time()
    fn(*args)
    return (time.thread_time() - t0) * 1e3


def main() -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
    dtype, kernels = getattr(torch, a.dtype), load()
    print(f"threads: {torch.get_num_threads()}; {a.dtype}, {a.rows} rows")
    gen = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(HIDDEN, eps=EPS).to(dtype)
    x = (torch.randn(1, a.rows, HIDDEN, generator=gen) * 2).to(dtype)
    # the MLP's elementwise part alone: identity projections would cost a product, so act(gate) * up on the
    # halves of a gate/up product, as SiluAndMulMLP's kernel and HF's code compute it
    mlp = LlamaMLP(LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE)).to(dtype)
    gate_up = (torch.randn(1, a.rows, 2 * INTERMEDIATE, generator=gen) * 2).to(dtype)
    gate, up = gate_up[..., :INTERMEDIATE], gate_up[..., INTERMEDIATE:]
    fused_norm = FusedRMSNorm(norm, kernels)

    def hf_silu_mul(g, u):
        return mlp.act_fn(g) * u

    def cpp_silu_mul(g, u):  # SiluAndMulMLP's kernel call
        h = torch.empty(g.shape[1:], dtype=g.dtype)
        kernels.silu_and_mul(h, g[0], u[0])
        return h[None]

    with torch.inference_mode():
        t0 = time.thread_time()
        compiled_norm = torch.compile(norm, dynamic=True)
        compiled_silu_mul = torch.compile(hf_silu_mul, dynamic=True)
        compiled_norm(x), compiled_silu_mul(gate, up)
        print(f"torch.compile of both, first call: {time.thread_time() - t0:.1f} s CPU")
        ways = {
            "RMSNorm": (norm, {"HF": norm, "C++": fused_norm, "inductor": compiled_norm}, (x,)),
            "SiLU-and-mul": (
                hf_silu_mul,
                {"HF": hf_silu_mul, "C++": cpp_silu_mul, "inductor": compiled_silu_mul},
                (gate, up),
            ),
        }
        for op, (ref, fns, args) in ways.items():
            want = ref(*args)
            same = {k: (fn(*args) == want).float().mean().item() for k, fn in fns.items()}
            times: dict[str, list[float]] = {k: [] for k in fns}
            for i in range(a.repeat):
                for k in list(fns) if i % 2 == 0 else list(fns)[::-1]:
                    times[k].append(cpu_ms(fns[k], *args))
            cells = ", ".join(
                f"{k} {min(v):.2f}/{sorted(v)[len(v) // 2]:.2f} ms ({100 * same[k]:.3f}% equal)"
                for k, v in times.items()
            )
            print(f"{op}: best/median {cells}")


if __name__ == "__main__":
    main()
