"""Facts about this machine, found once and read by every layer: where the cache folder is, what the CPU can do,
which device and dtype a job's `auto` means here, how much memory is free. The bottom of the package with
errors.py: it imports nothing else of batchrun's (docs/ARCHITECTURE.md, "How the code is laid out")."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import BadInput

if TYPE_CHECKING:  # torch only where a device or dtype is asked for: `batchrun validate` stays light
    import torch


def cache_dir() -> Path:
    """batchrun's cache folder: converted GGUF models, the built CPU kernels."""
    return Path(os.environ.get("BATCHRUN_CACHE", Path.home() / ".cache" / "batchrun"))


def pick_device(requested: str) -> torch.device:
    """`engine.device` resolved: auto is CUDA where there is one, else the CPU."""
    import torch

    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise BadInput(f"engine.device is {requested!r} but no CUDA device is available; use auto or cpu.")
    return torch.device(requested)


@dataclass(frozen=True)
class Placement:
    """Where and in what dtype a model runs: `engine.device` and `model.dtype` resolved once (`place`), then
    passed down to whatever needs them (the job's fingerprint, the model's load)."""

    device: torch.device
    dtype: torch.dtype


def place(device_request: str, dtype_request: str) -> Placement:
    """`engine.device` and `model.dtype` as this machine resolves them (auto included)."""
    device = pick_device(device_request)
    return Placement(device, pick_dtype(dtype_request, device))


def cpu_description() -> str:
    """This CPU's model name and flags lines (Linux's /proc/cpuinfo; empty elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    model = next((line for line in lines if line.startswith("model name")), "")
    flags = next((line for line in lines if line.startswith(("flags", "Features"))), "")
    return f"{model}\n{flags}"


def cpu_name() -> str:
    """This CPU in one line, for figures: its model name and the vector units that matter here."""
    model = cpu_description().partition("\n")[0].partition(":")[2].strip() or "an unknown CPU"
    flags = cpu_flags()
    units = [
        name
        for flag, name in (("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX"))
        if flag in flags
    ]
    return f"{model} ({', '.join(units) or 'no AVX-512'})"


def cpu_isa() -> str:
    """`BATCHRUN_CPU_ISA`: `native` (the default), or `avx2`: this CPU taken for one without AVX-512 (an AMD EPYC
    with AVX2, as most rented CPUs): the C++ kernels built for AVX2 (engine/cpu_kernels.py) and `cpu_flags`
    without the flags past AVX2, so that a CPU with AVX-512 runs the paths such a CPU runs (`make test-avx2`, where
    `ATEN_CPU_CAPABILITY=avx2` and `ONEDNN_MAX_CPU_ISA=AVX2` hold torch to AVX2 too)."""
    isa = os.environ.get("BATCHRUN_CPU_ISA", "native")
    if isa not in ("native", "avx2"):
        raise BadInput(f"BATCHRUN_CPU_ISA is {isa!r}: native (the default) or avx2")
    return isa


def cpu_flags() -> set[str]:
    """This CPU's feature flags (empty where /proc/cpuinfo says none); under `BATCHRUN_CPU_ISA=avx2` an AVX2
    CPU's: none of AVX-512, AVX10, AMX or the later AVX extensions (AVX-VNNI, AVX-NE-CONVERT)."""
    flags = set(cpu_description().partition("\n")[2].partition(":")[2].split())
    if cpu_isa() == "avx2":
        return {flag for flag in flags if not flag.startswith(("avx512", "avx10", "avx_", "amx"))}
    return flags


def cpu_packs_bf16() -> bool:
    """Whether oneDNN can reorder bf16 weights into its blocked layout here: it needs AVX-512 (BW, VL and DQ) or
    AVX-NE-CONVERT, and raises elsewhere (an AMD EPYC with AVX2 only)."""
    flags = cpu_flags()
    return {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AMX or AVX512-BF16)."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def slow_dtype(placement: Placement) -> str | None:
    """Why `placement`'s dtype runs slowly on this machine, or None: bfloat16 asked for on a CPU without bf16
    hardware, where every product is emulated (model.dtype auto picks float32 there; bench/RESULTS.md)."""
    import torch

    if placement.device.type == "cpu" and placement.dtype == torch.bfloat16 and not cpu_has_fast_bf16():
        return (
            "model.dtype bfloat16 on a CPU without bf16 hardware (AMX or AVX512-BF16): its products are emulated, "
            "several times slower than float32 here (model.dtype auto picks float32 on this CPU)"
        )
    return None


def warn_slow_dtype(placement: Placement) -> str | None:
    """slow_dtype's reason, said on stderr as the model loads (a warning: the job runs, slowly) and returned for
    the run's summary."""
    note = slow_dtype(placement)
    if note:
        print(f"batchrun: warning: {note}.", file=sys.stderr, flush=True)
    return note


def pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    """`model.dtype` resolved: auto is bf16 where the device runs it fast (CUDA with bf16, else fp16; a CPU with
    AMX or AVX512-BF16: faster than fp32 there, bench/RESULTS.md), else fp32."""
    import torch

    if requested != "auto":
        return getattr(torch, requested)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu" and cpu_has_fast_bf16():
        return torch.bfloat16
    return torch.float32


def available_ram() -> int:
    """Memory a new allocation can get without swapping (MemAvailable), in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30
