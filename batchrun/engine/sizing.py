"""How big the engine's pools are: pages from a byte budget, the model's context limit, and the check that a
budget fits the memory there is (made before the model loads, so a bad budget is a bad job, not a crash)."""

from __future__ import annotations

import torch

from ..checks import parse_size
from ..errors import BadInput
from ..host import available_ram
from .config import EngineConfig
from .kv_cache import KVCacheShape

CPU_KV_SHARE = 0.1  # on the CPU, kv_cache_memory as a fraction means a fraction of a tenth of available RAM


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_memory_budget(config: EngineConfig, model_config, dtype: torch.dtype, device: torch.device) -> None:
    """A KV budget larger than the memory there is: BadInput naming the key and what is available, before the
    model loads (rather than a MemoryError, or the OOM killer, minutes later)."""
    bytes_per_page = KVCacheShape.of_model(model_config, config.page_size, dtype).bytes_per_page
    ram = available_ram()
    if device.type == "cuda":
        accelerator, _ = torch.cuda.mem_get_info(device)
        where = f"free on {device}"
    else:
        accelerator, where = ram, "of available RAM"
    wanted = []
    if config.num_pages is not None:
        wanted.append(("engine.num_pages", config.num_pages * bytes_per_page, accelerator, where))
    elif not isinstance(config.kv_cache_memory, float | int):
        wanted.append(("engine.kv_cache_memory", parse_size(config.kv_cache_memory), accelerator, where))
    wanted.append(("engine.swap_space", parse_size(config.swap_space), ram, "of available RAM"))
    for key, need, have, what in wanted:
        if need > have:
            raise BadInput(
                f"key `{key}`: asks for {_gib(need)} but only {_gib(have)} is {what}; lower it "
                f"({bytes_per_page} bytes per KV page)."
            )
    if device.type == "cpu" and len(wanted) == 2 and wanted[0][1] + wanted[1][1] > ram:
        raise BadInput(
            f"keys `{wanted[0][0]}` and `engine.swap_space`: together ask for {_gib(wanted[0][1] + wanted[1][1])} "
            f"of RAM but only {_gib(ram)} is available; lower one of them."
        )


def model_max_len(model_config) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(model_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 8192


def num_pages_for(config: EngineConfig, bytes_per_page: int, device: torch.device) -> int:
    """`engine.num_pages`, or as many pages as `engine.kv_cache_memory` holds."""
    if config.num_pages is not None:
        return config.num_pages
    mem = config.kv_cache_memory
    if isinstance(mem, float | int):
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * mem)
        else:
            budget = int(available_ram() * CPU_KV_SHARE * mem)
    else:
        budget = parse_size(mem)
    pages = budget // bytes_per_page
    if pages < 1:
        raise BadInput(
            f"key `engine.kv_cache_memory`: {mem!r} leaves room for no KV page "
            f"({bytes_per_page} bytes each); give more memory or set engine.num_pages."
        )
    return pages
