"""batchrun's C++ kernels for the CPU (cpu_kernels.cpp): paged decode attention that reads K/V in the pages, and
the greedy argmax over a step's logits; (cpu_elementwise.cpp) a bf16/fp16 layer's RMSNorm and SiLU-and-mul, and
HF's rotary in any dtype; and (cpu_prompt_attention.cpp, cpu_decode_bf16.cpp) a bf16 layer's prompt and decode
attention with AVX512-BF16 dot products; (cpu_kv_write.cpp) a layer's K/V written to their pages; and
(cpu_residual.cpp) a decoder layer's residual adds in place.

Built with torch's C++ extension builder (a C++ compiler and `ninja` are needed) by `make install`
(`python -m batchrun.engine.cpu_kernels`), or else at first use, into the cache folder
(`$BATCHRUN_CACHE/torch_extensions`, default ~/.cache/batchrun), then loaded in well under a second. The build
folder is keyed by the sources and their checkout, the torch install and version, Python's version and include
folder, and the CPU (`build_dir`): two checkouts or installed versions never rebuild each other's build in turn,
two environments over one torch share one, and a job waits on a build lock only while its very build is made.
Built for this CPU (`-march=native`), or under `BATCHRUN_CPU_ISA=avx2` for an AVX2 CPU (x86-64-v3: AVX2, FMA and
F16C; no AVX-512 of any kind, no AMX), in a folder of its own: most rented CPUs (an AMD EPYC with AVX2 only) run
the kernels' non-AVX-512 paths, and this lets a CPU with AVX-512 run them too (`make test-avx2`, with torch held to
AVX2 by `ATEN_CPU_CAPABILITY=avx2` and `ONEDNN_MAX_CPU_ISA=AVX2`; host.cpu_isa).
Where it cannot be built, `load()` warns with the reason and returns None: `attention: torch` falls back to
`gather`, and `argmax_rows` to torch's argmax.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
from filelock import FileLock

from batchrun.host import cache_dir, cpu_description, cpu_isa

CSRC = Path(__file__).with_name("csrc")  # the C++ sources
SOURCE = CSRC / "cpu_kernels.cpp"
ELEMENTWISE = CSRC / "cpu_elementwise.cpp"  # compiled into the same module
PROMPTS = CSRC / "cpu_prompt_attention.cpp"  # this one too
DECODE_BF16 = CSRC / "cpu_decode_bf16.cpp"  # and this one
KV_WRITE = CSRC / "cpu_kv_write.cpp"  # and these two
RESIDUAL = CSRC / "cpu_residual.cpp"
HEADERS = [CSRC / h for h in ("cpu_vector.h", "cpu_decode.h")]  # what they include
_loaded: dict[str, object] = {}


def load():
    """The compiled module (`paged_decode_attention`, `paged_prompt_attention`, `argmax_rows`, `rms_norm`,
    `rms_norm_scale`, `silu_and_mul`, `silu_and_mul_halves`, `rotary_embedding`, `write_kv`, `residual_add`,
    `add_rms_norm`), or None when it cannot be built here."""
    if "module" in _loaded:
        return _loaded["module"]
    module = None
    march = target_flags()  # a misspelt BATCHRUN_CPU_ISA is an error (BadInput), not a build for another CPU
    try:
        from torch.utils import cpp_extension

        build = build_dir()
        build.mkdir(parents=True, exist_ok=True)
        with FileLock(build / "batchrun.lock"):
            # torch's builder marks a build in progress with a `lock` file and waits, forever, for it to go; a
            # process killed mid-build leaves it behind. Our OS lock dies with its process: holding it, nobody
            # else is building, so such a file is stale.
            (build / "lock").unlink(missing_ok=True)
            module = _build(cpp_extension, build, march)
    except Exception as e:  # no compiler, no ninja: the gather path still works
        warnings.warn(
            f"batchrun: the CPU kernels could not be built ({e}); gathering pages for attention instead",
            stacklevel=2,
        )
    _loaded["module"] = module
    return module


def build_dir() -> Path:
    """Where the extension is built: one folder per source, checkout, torch install, Python, kind of CPU and
    target (-march; a cache folder may be shared between machines and versions). torch's build file names the
    sources' paths and torch's and Python's include folders, so two checkouts, or two torch installs, sharing a
    folder would rebuild it each time the other ran; two environments over one torch install (`make test`'s
    .venv-quant over .venv) write the same build file and share one build."""
    return cache_dir() / "torch_extensions" / f"cpu_kernels-{_build_key()}"


def target_flags() -> list[str]:
    """The compiler's target: this CPU, or an AVX2 CPU under `BATCHRUN_CPU_ISA=avx2` (host.cpu_isa)."""
    return ["-march=x86-64-v3"] if cpu_isa() == "avx2" else ["-march=native"]


def _build(cpp_extension, build: Path, march: list[str]):
    """Compile (when the source changed) and load the extension from `build`, for the target `march`."""
    return cpp_extension.load(
        name="batchrun_cpu_kernels",
        sources=[str(f) for f in (SOURCE, ELEMENTWISE, PROMPTS, DECODE_BF16, KV_WRITE, RESIDUAL)],
        # -fopenmp: at::parallel_for spreads the tasks over torch's threads only when compiled with it;
        # no errno from math calls lets the softmax loop (floor) vectorize
        extra_cflags=["-O3", *march, "-fopenmp", "-fno-math-errno"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build),
        verbose=os.environ.get("BATCHRUN_DEBUG") == "1",
    )


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value, as `logits.float().argmax(-1)` decides it (first index on ties, a
    NaN counts as the largest): by the C++ kernel for fp32 and bf16 rows on the CPU, else by torch."""
    if (
        logits.device.type == "cpu"
        and logits.dtype in (torch.float32, torch.bfloat16)
        and logits.stride(-1) == 1
    ):
        module = load()
        if module is not None:
            return module.argmax_rows(logits)
    return logits.float().argmax(dim=-1)


def _build_key() -> str:
    import hashlib
    import platform
    import sys
    import sysconfig

    key = hashlib.sha256(
        b"".join(
            f.read_bytes() for f in (SOURCE, ELEMENTWISE, PROMPTS, DECODE_BF16, KV_WRITE, RESIDUAL, *HEADERS)
        )
    )
    # Python's include folder as torch's builder reads it (cpp_extension names it in the build file)
    python_include = sysconfig.get_path("include", scheme="nt" if os.name == "nt" else "posix_prefix")
    torch_install = Path(torch.__file__).parent
    key.update(
        f"{torch.__version__}|{torch_install}|{sys.version_info[:2]}|{python_include}|{SOURCE.parent}|"
        f"{platform.machine()}|{cpu_description()}|{target_flags()}".encode()
    )
    return key.hexdigest()[:16]


if __name__ == "__main__":  # `make install`: build now, not in the first job
    built = load()
    print(f"batchrun CPU kernels: {'built in ' + str(build_dir()) if built is not None else 'not built'}")
