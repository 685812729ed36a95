"""Large host blocks kept for reuse between steps, on a CPU engine.

glibc's malloc takes blocks over its mmap threshold (at most 32 MB by its own adjustment) straight from the
kernel and gives them back when they are freed, so the largest tensors of a step -- the logits (256 rows x
49,152 fp32 = 50 MB), a long prompt's activations -- fault in fresh zeroed pages every step and are unmapped
after it. Raising the mmap and trim thresholds keeps freed blocks in the heap for the next step: faster on the
reference workload of `python -m bench.vs_vllm` (fp32, sharing off; glibc's MALLOC_MMAP_THRESHOLD_ and
MALLOC_TRIM_THRESHOLD_ set and not, alternated: the figures are in bench/RESULTS.md). The price: the process
keeps its peak heap instead of returning it to the system.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30  # 1 GiB: blocks under it come from the heap and return to it
TRIM_THRESHOLD = (1 << 31) - 1  # free heap top kept before trimming: the largest value mallopt's int takes


def keep_freed_blocks() -> bool:
    """Tell glibc's malloc to reuse freed blocks under MMAP_THRESHOLD; False where there is no mallopt (macOS)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        return False
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
