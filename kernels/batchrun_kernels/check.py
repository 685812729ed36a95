"""`make kernels-check`: compile every Triton kernel specialization the engine can launch, ahead of time, for
the GPUs batchrun targets, with Triton's own compiler — no GPU needed (ptxas ships with the triton wheel).

For each (kernel, dtype, compile-time arguments) in `paged_attention.specializations()` and each target
(sm_80, sm_90) it runs `triton.compile` with a `GPUTarget`, then `ptxas -v` on the PTX for registers and
spills, and prints one line each with the shared memory the kernel needs. Exit 1 when one does not compile or
needs more shared memory than the target has; a kernel that spills registers is reported, not failed.

Usage: python -m batchrun_kernels.check [--jobs N] [--arch 80,90]
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

# bytes of shared memory one block may use (the opt-in maximum)
SHARED_MEMORY = {80: 163 * 1024, 90: 227 * 1024}
TRITON_TYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


MODULES = ("paged_attention", "lora")  # every module of kernels, each with its `specializations()`


def _kernels(module: str = "paged_attention"):
    # `batchrun_kernels.paged_attention` is also the name of the launcher function the package exports
    return importlib.import_module(f"batchrun_kernels.{module}")


def signature(fn, dtype_name: str, constexprs: dict, types: dict | None = None) -> dict[str, str]:
    """Triton signature of `fn`: pointers to K/V/query/output in `dtype_name`, index pointers int32, strides
    and run-time sizes int32, the scale fp32; `constexprs` left out (they are passed separately); `types`: the
    arguments whose type the kernel's module states itself."""
    data = "*" + TRITON_TYPES[dtype_name]
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif types and name in types:
            sig[name] = types[name]
        elif name in (
            "block_tables_ptr",
            "query_start_ptr",
            "seq_lens_ptr",
            "block_seq_ptr",
            "block_index_ptr",
        ):
            sig[name] = "*i32"
        elif name == "slot_ptr":
            sig[name] = "*i64"
        # fp32 whatever the model's dtype (the launcher converts)
        elif name in ("sinks_ptr", "rel_ptr", "alibi_ptr"):
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = data
        elif name in ("scale", "softcap"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def compile_one(job: tuple[str, str, str, dict, dict, int, dict | None]) -> dict:
    module, kernel_name, dtype_name, constexprs, options, arch, types = job
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    fn = getattr(_kernels(module), kernel_name)
    row = {"kernel": kernel_name.strip("_"), "arch": f"sm_{arch}", "dtype": dtype_name, **constexprs}
    row["WARPS"] = options["num_warps"]
    t0 = time.perf_counter()
    try:
        src = ASTSource(fn, signature(fn, dtype_name, constexprs, types), constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
        with tempfile.TemporaryDirectory() as tmp:
            ptx = os.path.join(tmp, "k.ptx")
            with open(ptx, "w") as f:
                f.write(compiled.asm["ptx"])
            gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
            log = subprocess.run(
                [get_ptxas(arch).path, "-v", f"--gpu-name={gpu}", ptx, "-o", os.path.join(tmp, "k.cubin")],
                capture_output=True,
                text=True,
                check=True,
            ).stderr
        regs = re.search(r"Used (\d+) registers", log)
        spills = re.search(r"(\d+) bytes spill stores", log)
        row.update(
            ok=compiled.metadata.shared <= SHARED_MEMORY[arch],
            registers=int(regs.group(1)) if regs else None,
            spill_bytes=int(spills.group(1)) if spills else None,
            shared_bytes=compiled.metadata.shared,
            num_warps=compiled.metadata.num_warps,
            error=None if compiled.metadata.shared <= SHARED_MEMORY[arch] else "shared memory over the limit",
        )
    except Exception as e:  # a compile error is the finding: report it with the specialization
        row.update(ok=False, error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}")
    row["seconds"] = time.perf_counter() - t0
    return row


def jobs(archs: list[int]) -> list[tuple[str, str, str, dict, dict, int, dict | None]]:
    out = []
    for module in MODULES:
        for fn, dtype, constexprs, options, *types in _kernels(module).specializations():
            for arch in archs:
                dtype_name = str(dtype).replace("torch.", "")
                out.append(
                    (module, fn.__name__, dtype_name, constexprs, options, arch, types[0] if types else None)
                )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--arch", default="80,90")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("kernels-check: unset TRITON_INTERPRET (it compiles for the GPU)", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, said out loud
    todo = jobs([int(a) for a in args.arch.split(",")])
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(compile_one, todo, chunksize=4))
    head = f"{'kernel':<22} {'arch':<6} {'dtype':<9} {'compile-time arguments':<58} regs spill  smem"
    print(head)
    for r in rows:
        consts = " ".join(f"{k}={v}" for k, v in r.items() if k.isupper())
        if r["error"] and r.get("shared_bytes") is None:
            print(f"{r['kernel']:<22} {r['arch']:<6} {r['dtype']:<9} {consts:<58} FAILED {r['error']}")
            continue
        print(
            f"{r['kernel']:<22} {r['arch']:<6} {r['dtype']:<9} {consts:<58} {r['registers']:>4} "
            f"{r['spill_bytes']:>5} {r['shared_bytes']:>5}" + (f"  FAILED {r['error']}" if r["error"] else "")
        )
    failed = [r for r in rows if not r["ok"]]
    spilling = [r for r in rows if r.get("spill_bytes")]
    print(
        f"kernels-check: {len(rows) - len(failed)}/{len(rows)} specializations compiled for "
        f"{', '.join(f'sm_{a}' for a in args.arch.split(','))} in {time.perf_counter() - t0:.0f} s; "
        f"{len(spilling)} spill registers; {len(failed)} failed"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
