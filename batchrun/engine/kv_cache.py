"""The page tensors: the accelerator pool, the (pinned, on CUDA) CPU swap pool, and the copies between them.

Each pool is a K pool and a V pool, [layers of a page, num_pages, page_size, num_kv_heads, head_dim] each (K and
V may differ in head dim: MLA models such as DeepSeek-V3 have wider keys than values), so one page of one layer
is a contiguous [page_size, num_kv_heads, head_dim] block, and a swap moves every layer of a set of pages in one
indexed copy per pool. A page holds P tokens of one KV cache group's layers (architecture.KVGroups): all the
model's layers when they attend alike; layer l of the model is the slot `layer_slot[l]` of its group's pages.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from .page_pool import PageCopy


@dataclass(frozen=True)
class KVCacheShape:
    num_layers: (
        int  # layers a page holds: one KV cache group's (all the model's, when its layers attend alike)
    )
    num_kv_heads: int
    head_dim: int  # of the keys (and queries)
    page_size: int
    dtype: torch.dtype
    v_head_dim: int | None = None  # of the values, where it differs (MLA); None: head_dim

    @property
    def value_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def bytes_per_page(self) -> int:
        per_token = self.num_kv_heads * (self.head_dim + self.value_dim)
        return self.num_layers * self.page_size * per_token * self.dtype.itemsize

    @classmethod
    def of_model(cls, model_config, page_size: int, dtype: torch.dtype) -> KVCacheShape:
        """The page shape a `transformers` model config suggests, before the model is loaded (for sizing checks);
        the engine takes the shape the loaded model's layers actually produce (architecture.inspect_model). A
        vision-language model's config holds its language model's in `text_config`: that one is read."""
        cfg = text_config(model_config)
        layers = layers_per_page(cfg)
        if getattr(
            cfg, "kv_lora_rank", None
        ):  # MLA: keys of the nope + rope dims, one KV head per query head
            k_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
            return cls(layers, cfg.num_attention_heads, k_dim, page_size, dtype, cfg.v_head_dim)
        head_dim = _largest(cfg, "head_dim") or cfg.hidden_size // _largest(cfg, "num_attention_heads")
        num_kv_heads = _largest(cfg, "num_key_value_heads") or _largest(cfg, "num_attention_heads")
        return cls(layers, num_kv_heads, head_dim, page_size, dtype)


def text_config(cfg):
    """The language model's config (a vision-language model's `text_config`; the config itself otherwise)."""
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def layers_per_page(cfg) -> int:
    """The layers one page holds, from the config: those of one KV cache group, as the engine forms them
    (architecture.KVGroups: the attention layers by kind, in groups of the gcd of the kinds' counts), so that
    `engine.num_pages` means the same pages before the load and after. Without `layer_types`: every layer."""
    types = [t for t in getattr(cfg, "layer_types", None) or [] if t in ATTENTION_LAYER_TYPES]
    if not types:
        return cfg.num_hidden_layers
    return math.gcd(*(types.count(t) for t in set(types)))


def _largest(cfg, key: str):
    """A config value, or its largest over the layers where the config gives one per layer (Gemma 4's
    `per_layer_config`: sliding and full layers of different head dims): an upper bound for the budget check."""
    layers = getattr(cfg, "per_layer_config", None)
    if layers:
        values = [getattr(c, key, None) for c in layers]
        return max((v for v in values if v), default=None)
    return getattr(cfg, key, None)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeroed pages. On the CPU an anonymous mapping, which the OS zeroes lazily, 4 KiB at a time: the process
    grows only by the pages actually written, and start-up touches nothing. Not in 2 MiB pages (numpy's calloc
    asks for those): each first write into one then zeroes 2 MiB, and on the reference workload the K/V writes
    took several times as long (bench/RESULTS.md, 2026-11-30 night)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * dtype.itemsize
    pages = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(pages, dtype=torch.uint8)[:size].view(dtype).view(shape)  # keeps `pages` alive


class KVCache:
    def __init__(self, shape: KVCacheShape, num_pages: int, num_cpu_pages: int, device: torch.device):
        self.shape = shape
        self.device = device
        L, P, H = shape.num_layers, shape.page_size, shape.num_kv_heads
        # [layers, pages, page_size, kv heads, head dim]: the K pool and the V pool
        self.pages = tuple(_zeros((L, num_pages, P, H, d), shape.dtype, device) for d in self._dims)
        pin = device.type == "cuda"
        # never read before written, so not zeroed (zeroing gigabytes costs seconds at start-up); the accelerator
        # pool is zeroed: masked-out slots of a page are still multiplied by zero, and garbage could be NaN
        self.cpu_pages = tuple(
            torch.empty(L, num_cpu_pages, P, H, d, dtype=shape.dtype, pin_memory=pin) for d in self._dims
        )

    @property
    def _dims(self) -> tuple[int, int]:
        return self.shape.head_dim, self.shape.value_dim

    def layer(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V pages of one layer slot of every page, [num_pages, page_size, num_kv_heads, head_dim (K's or
        V's)]: the layer's K/V live in its group's pages (KVGroups.layer_slot)."""
        return self.pages[0][slot], self.pages[1][slot]

    def apply(self, swap_out: list[PageCopy], swap_in: list[PageCopy], copy_on_write: list[PageCopy]) -> None:
        """Carry out a step's page copies, in the only safe order: out, in, copy-on-write."""
        if swap_out:
            src = torch.tensor([c.src for c in swap_out], device=self.device)
            dst = torch.tensor([c.dst for c in swap_out])
            for pool, cpu in zip(self.pages, self.cpu_pages):
                cpu[:, dst] = pool[:, src].to("cpu")
        if swap_in:
            src = torch.tensor([c.src for c in swap_in])
            dst = torch.tensor([c.dst for c in swap_in], device=self.device)
            for pool, cpu in zip(self.pages, self.cpu_pages):
                pool[:, dst] = cpu[:, src].to(self.device, non_blocking=True)
        if copy_on_write:
            src = torch.tensor([c.src for c in copy_on_write], device=self.device)
            dst = torch.tensor([c.dst for c in copy_on_write], device=self.device)
            for pool in self.pages:
                pool[:, dst] = pool[:, src]
