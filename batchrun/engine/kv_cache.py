"""The page tensors: the accelerator pool, the (pinned, on CUDA) CPU swap pool, and the copies between them.

Layout of both pools: [num_layers, 2 (K, V), num_pages, page_size, num_kv_heads, head_dim], so one page of one
layer is a contiguous [page_size, num_kv_heads, head_dim] block, and a swap moves every layer of a set of pages
in one indexed copy.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from .block_manager import PageCopy


@dataclass(frozen=True)
class KVCacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @property
    def bytes_per_page(self) -> int:
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @classmethod
    def of_model(cls, model_config, page_size: int, dtype: torch.dtype) -> KVCacheShape:
        """The page shape a `transformers` model config needs."""
        cfg = model_config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        return cls(cfg.num_hidden_layers, num_kv_heads, head_dim, page_size, dtype)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeroed pages. On the CPU an anonymous mapping, which the OS zeroes lazily, 4 KiB at a time: the process
    grows only by the pages actually written, and start-up touches nothing. Not in 2 MiB pages (numpy's calloc
    asks for those): each first write into one then zeroes 2 MiB, and on the reference workload the K/V writes
    took 1.4-1.5 s of a 31 s run instead of 0.35 (bench/RESULTS.md)."""
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
        dims = (shape.num_layers, 2)
        page = (shape.page_size, shape.num_kv_heads, shape.head_dim)
        self.pages = _zeros((*dims, num_pages, *page), shape.dtype, device)
        pin = device.type == "cuda"
        # never read before written, so not zeroed (zeroing gigabytes costs seconds at start-up); the accelerator
        # pool is zeroed: masked-out slots of a page are still multiplied by zero, and garbage could be NaN
        self.cpu_pages = torch.empty(*dims, num_cpu_pages, *page, dtype=shape.dtype, pin_memory=pin)

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V pages of one layer, each [num_pages, page_size, num_kv_heads, head_dim]."""
        return self.pages[layer_idx, 0], self.pages[layer_idx, 1]

    def apply(self, swap_out: list[PageCopy], swap_in: list[PageCopy], copy_on_write: list[PageCopy]) -> None:
        """Carry out a step's page copies, in the only safe order: out, in, copy-on-write."""
        if swap_out:
            src = torch.tensor([c.src for c in swap_out], device=self.device)
            dst = torch.tensor([c.dst for c in swap_out])
            self.cpu_pages[:, :, dst] = self.pages[:, :, src].to("cpu")
        if swap_in:
            src = torch.tensor([c.src for c in swap_in])
            dst = torch.tensor([c.dst for c in swap_in], device=self.device)
            self.pages[:, :, dst] = self.cpu_pages[:, :, src].to(self.device, non_blocking=True)
        if copy_on_write:
            src = torch.tensor([c.src for c in copy_on_write], device=self.device)
            dst = torch.tensor([c.dst for c in copy_on_write], device=self.device)
            self.pages[:, :, dst] = self.pages[:, :, src]
