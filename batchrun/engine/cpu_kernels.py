"""batchrun's C++ kernel for the CPU: paged decode attention that reads K/V in the pages (paged_decode.cpp).

Built once with torch's C++ extension builder (a C++ compiler and `ninja` are needed) into the cache folder
(`$BATCHRUN_CACHE/torch_extensions`, default ~/.cache/batchrun), then loaded in well under a second. Where it
cannot be built, `load()` warns with the reason and returns None, and `attention: torch` falls back to `gather`.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

SOURCE = Path(__file__).with_name("paged_decode.cpp")
_loaded: dict[str, object] = {}


def load():
    """The compiled module (with `paged_decode_attention`), or None when it cannot be built here."""
    if "module" in _loaded:
        return _loaded["module"]
    module = None
    try:
        from torch.utils import cpp_extension

        from ..model_loader import cache_dir

        # built with -march=native: one build per kind of CPU (a cache folder may be shared between machines)
        build = cache_dir() / "torch_extensions" / f"paged_decode-{_cpu_id()}"
        build.mkdir(parents=True, exist_ok=True)
        module = cpp_extension.load(
            name="batchrun_paged_decode",
            sources=[str(SOURCE)],
            # -fopenmp: at::parallel_for spreads the tasks over torch's threads only when compiled with it;
            # no errno from math calls lets the softmax loop (floor) vectorize
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            verbose=os.environ.get("BATCHRUN_DEBUG") == "1",
        )
    except Exception as e:  # no compiler, no ninja: the gather path still works
        warnings.warn(
            f"batchrun: the CPU paged-decode kernel could not be built ({e}); gathering pages instead",
            stacklevel=2,
        )
    _loaded["module"] = module
    return module


def _cpu_id() -> str:
    import hashlib
    import platform

    from ..model_loader import cpu_description

    return hashlib.sha256(f"{platform.machine()}|{cpu_description()}".encode()).hexdigest()[:12]
