"""How big the engine's pools are: pages from a byte budget, the model's context limit, and the check that a
budget fits the memory there is (made before the model loads, so a bad budget is a bad job, not a crash).

The check needs a KV page's bytes before the load, and the KV layout is worked out in one place: the load probe
(architecture.inspect_model). So the check runs that very probe on the model made on the meta device from its
config (loading.meta_paged_model: shapes, no weights) rather than a second reading of the config beside it: a
family quirk that changes the layout is one change, in the model's code or a family adapter the probe applies,
and the check before the load sees it as the engine does. A model whose forward cannot run on the meta device
(its own code reads token values: dynamic NTK's cache growth, a router's nonzero) is checked on its byte sizes
alone, as when no config is at hand; the load then probes it as any other."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchrun.checks import parse_size
from batchrun.engine.config import EngineConfig
from batchrun.engine.core.cache_spec import StateSpec
from batchrun.engine.core.state_slots import StatePool, state_pool
from batchrun.engine.model.architecture import inspect_model
from batchrun.engine.model.loading import meta_paged_model
from batchrun.engine.model.structure import text_config
from batchrun.errors import BadInput
from batchrun.host import available_ram

CPU_KV_SHARE = 0.1  # on the CPU, kv_cache_memory as a fraction means a fraction of a tenth of available RAM
# engine.swap_space unset: this share of the RAM available at start, and no more than AUTO_SWAP_MAX
AUTO_SWAP_SHARE = 0.25
AUTO_SWAP_MAX = 4 << 30
AUTO_SWAP_RULE = (
    f"the smaller of {AUTO_SWAP_MAX >> 30} GiB and {AUTO_SWAP_SHARE:.0%} of the RAM available at start"
)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_memory_budget(config: EngineConfig, model_config, dtype: torch.dtype, device: torch.device) -> None:
    """A KV budget larger than the memory there is: BadInput naming the key and what is available, before the
    model loads (rather than a MemoryError, or the OOM killer, minutes later). `model_config` None (not read
    yet): the byte sizes alone, not `engine.num_pages`."""
    bytes_per_page = kv_page_bytes(model_config, config.page_size, dtype) if model_config else 0
    ram = available_ram()
    if device.type == "cuda":
        accelerator, _ = torch.cuda.mem_get_info(device)
        where = f"is free on {device}"
    else:
        accelerator, where = ram, "of RAM is available"
    wanted = []
    if config.num_pages is not None:
        if bytes_per_page:
            wanted.append(("engine.num_pages", config.num_pages * bytes_per_page, accelerator, where))
    elif not isinstance(config.kv_cache_memory, float | int):
        wanted.append(("engine.kv_cache_memory", parse_size(config.kv_cache_memory), accelerator, where))
    if config.swap_space is not None:  # unset, it is sized to fit (swap_bytes)
        wanted.append(("engine.swap_space", parse_size(config.swap_space), ram, "of RAM is available"))
    for key, need, have, what in wanted:
        if need > have:
            raise BadInput(
                f"key `{key}`: asks for {_gib(need)}, and only {_gib(have)} {what}; lower it"
                + (" or leave it unset (what fits at start)" if key == "engine.swap_space" else "")
                + (f" ({bytes_per_page} bytes per KV page)." if bytes_per_page else ".")
            )
    if device.type == "cpu" and len(wanted) == 2 and wanted[0][1] + wanted[1][1] > ram:
        raise BadInput(
            f"keys `{wanted[0][0]}` and `engine.swap_space`: together ask for {_gib(wanted[0][1] + wanted[1][1])} "
            f"of RAM but only {_gib(ram)} is available; lower one of them."
        )


def kv_page_bytes(model_config, page_size: int, dtype: torch.dtype) -> int:
    """A KV page's bytes, from the load probe run on the model made on the meta device; 0 where that model
    cannot be made or probed there (the load reports what it refuses)."""
    try:
        return inspect_model(meta_paged_model(model_config)).kv_spec(page_size, dtype).bytes_per_page
    except Exception:  # noqa: BLE001 - a model batchrun refuses, or code that reads values: the load's to report
        return 0


def model_max_len(model_config) -> int:
    """The model's own limit on prompt + completion (model_limit)."""
    return model_limit(model_config)[0]


def model_limit(model_config) -> tuple[int, str]:
    """The model's own limit on prompt + completion, and where its config says it. Dynamic NTK scaling is made to
    run past `max_position_embeddings` (its original context): up to `factor` times it."""
    cfg = text_config(model_config)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            rope = getattr(cfg, "rope_parameters", None)
            if (
                key == "max_position_embeddings"
                and isinstance(rope, dict)
                and rope.get("rope_type") == "dynamic"
            ):
                factor = rope.get("factor", 1.0)
                limit = int(value * factor)
                return limit, f"its config's {key} {value} times its dynamic rope factor {factor}"
            return value, f"its config's {key}"
    return 8192, "no position limit in its config: batchrun's default"


def check_max_model_len(max_model_len: int | None, model_config) -> None:
    """`model.max_model_len` above the model's own limit: BadInput naming both (as vLLM refuses it at start),
    rather than a limit silently lowered to the model's."""
    limit, where = model_limit(model_config)
    if max_model_len is not None and max_model_len > limit:
        raise BadInput(
            f"key `model.max_model_len` is {max_model_len}, above the model's {limit} positions ({where}); set "
            f"it to at most {limit}, or leave it out."
        )


def swap_bytes(config: EngineConfig) -> int:
    """The CPU memory for swapped-out pages: `engine.swap_space` as set (check_memory_budget refused it beyond the
    available RAM), or unset AUTO_SWAP_RULE: a default that fits the machine it starts on rather than refusing the
    job there."""
    if config.swap_space is not None:
        return parse_size(config.swap_space)
    return min(AUTO_SWAP_MAX, int(available_ram() * AUTO_SWAP_SHARE))


@dataclass(frozen=True)
class PoolSizes:
    """The engine's pools: KV pages on the device and on the CPU, and a hybrid model's state slots (None: none)."""

    num_pages: int
    num_cpu_pages: int
    states: StatePool | None = None
    swap_bytes: int = 0  # the swap space the pools came from (swap_bytes: unset, what fit at start)


def pool_sizes(
    config: EngineConfig,
    bytes_per_page: int,
    num_groups: int,
    states: StateSpec | None,
    device: torch.device,
    reserved_bytes: int = 0,
) -> PoolSizes:
    """Pages, and a hybrid model's state slots (`states`: what a slot holds), from the KV budget and the swap
    space: the slots take their share (state_slots.state_pool), and the rest is pages. An explicit
    `engine.num_pages` is the pages alone; the slots then come on top.

    `reserved_bytes` come out of a budget given as memory first: a vision-language model's image features
    waiting for prefill (multimodal.EncoderCache)."""
    swap = swap_bytes(config)
    if states is None:
        return PoolSizes(
            num_pages_for(config, bytes_per_page, device, reserved_bytes), swap // bytes_per_page, None, swap
        )
    # the budget in bytes ("pages" of one byte); None: engine.num_pages fixes the pages
    budget = None if config.num_pages is not None else num_pages_for(config, 1, device, reserved_bytes)
    pool = state_pool(states, config, budget, swap, bytes_per_page, num_groups)
    pages = config.num_pages if budget is None else (budget - pool.device_bytes) // bytes_per_page
    return PoolSizes(pages, (swap - pool.cpu_bytes) // bytes_per_page, pool, swap)


def num_pages_for(
    config: EngineConfig, bytes_per_page: int, device: torch.device, reserved_bytes: int = 0
) -> int:
    """`engine.num_pages`, or as many pages as `engine.kv_cache_memory` holds once `reserved_bytes` are taken
    out of it."""
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
    pages = (budget - reserved_bytes) // bytes_per_page
    if pages < 1:
        beside = (
            f" beside the image features waiting for prefill ({reserved_bytes} bytes)"
            if reserved_bytes
            else ""
        )
        raise BadInput(
            f"key `engine.kv_cache_memory`: {mem!r} leaves room for no KV page{beside} "
            f"({bytes_per_page} bytes each); give more memory or set engine.num_pages."
        )
    return pages
