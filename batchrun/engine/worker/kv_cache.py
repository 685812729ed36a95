"""The page tensors: the accelerator pool, the (pinned, on CUDA) CPU swap pool, and the copies between them.

A page holds P tokens of one KV cache group's layers. The groups (cache_spec.KVGroups) are the model's attention layers
sorted by mask kind and K/V shape: a model whose layers all attend alike is one group of all its layers (the
plain paged cache); Gemma 3's 5 sliding : 1 full is 6 groups of 1 layer; Gemma 4, whose full-attention layers
have other head dims and KV heads than its sliding ones, has groups of each shape. Every page is one size, and
pages of every group come from one pool, so the scheduler counts pages alone: a group of smaller layers takes
more of them into a page (up to the page's size), and the rest of its pages is unused.

Each pool is [num_pages, page elements]: a page is one row, so a swap or a copy-on-write moves whole pages in
one indexed copy, whatever the groups. Inside a page each of the group's layers has its keys [P, Hkv, Dk] then
its values [P, Hkv, Dv] (MLA models such as DeepSeek-V3 have wider keys than values), contiguous per page: the
views `layer()` hands the backends are [num_pages, P, Hkv, D] with a page stride of the row.
"""

from __future__ import annotations

import math
import mmap
from typing import NamedTuple

import torch

from batchrun.engine.core.cache_spec import KVCacheSpec, KVShape, PageCopy


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


class LayerPages(NamedTuple):
    """One layer's place in the pages: views of the pool, [num_pages, page_size, num_kv_heads, head_dim] (a
    KV-shared layer's are its source layer's)."""

    k: torch.Tensor
    v: torch.Tensor


class KVCache:
    def __init__(self, spec: KVCacheSpec, num_pages: int, num_cpu_pages: int, device: torch.device):
        self.spec = spec
        self.device = device
        E = spec.page_elements
        self.pages = _zeros((num_pages, E), spec.dtype, device)  # [num_pages, page elements]
        # never read before written, so not zeroed (zeroing gigabytes costs seconds at start-up); the accelerator
        # pool is zeroed: masked-out slots of a page are still multiplied by zero, and garbage could be NaN
        self.cpu_pages = torch.empty(num_cpu_pages, E, dtype=spec.dtype, pin_memory=device.type == "cuda")
        groups = spec.groups
        views = {}  # (group, slot) -> K and V views
        for g, (shape, size) in enumerate(zip(groups.shapes, groups.sizes)):
            for slot in range(size):
                views[g, slot] = LayerPages(*self._views(shape, slot * spec.page_size * shape.elements))
        # per model layer (None: no attention), made once: every layer call of every step looks its pages up
        self._layers = [
            views[g, slot] if g >= 0 else None for g, slot in zip(groups.layer_group, groups.layer_slot)
        ]

    def _views(self, shape: KVShape, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's K and V pages, [num_pages, P, Hkv, Dk|Dv]: columns of the pool, from `start`."""
        P, H = self.spec.page_size, shape.num_kv_heads
        k_end = start + P * H * shape.head_dim
        v_end = k_end + P * H * shape.v_head_dim
        N = self.pages.shape[0]
        return (
            self.pages[:, start:k_end].view(N, P, H, shape.head_dim),
            self.pages[:, k_end:v_end].view(N, P, H, shape.v_head_dim),
        )

    def layer(self, layer: int) -> LayerPages:
        """A model layer's K and V pages (KVGroups.layer_group and layer_slot)."""
        return self._layers[layer]

    def apply(self, swap_out: list[PageCopy], swap_in: list[PageCopy], copy_on_write: list[PageCopy]) -> None:
        """Carry out a step's page copies, in the only safe order: out, in, copy-on-write."""
        if swap_out:
            src = torch.tensor([c.src for c in swap_out], device=self.device)
            dst = torch.tensor([c.dst for c in swap_out])
            self.cpu_pages[dst] = self.pages[src].to("cpu")
        if swap_in:
            src = torch.tensor([c.src for c in swap_in])
            dst = torch.tensor([c.dst for c in swap_in], device=self.device)
            self.pages[dst] = self.cpu_pages[src].to(self.device, non_blocking=True)
        if copy_on_write:
            src = torch.tensor([c.src for c in copy_on_write], device=self.device)
            dst = torch.tensor([c.dst for c in copy_on_write], device=self.device)
            self.pages[dst] = self.pages[src]
