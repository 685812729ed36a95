"""The attention backends, behind one registry. Each declares what it computes beyond paged causal attention
(`Capabilities`): the engine asks a capability, never a backend's name.

A backend has two methods: `build(step, group) -> plan`, called once per step and KV cache group while the step
is prepared (engine/model_runner.py), and `forward(meta, spec, call, q, k, v, scale) -> out [T, Hq, Dv]`, called
by every attention layer with the plan of its group (`meta.plans[spec.group]`).

- `torch` (the CPU default): decodes through batchrun's C++ kernel, prompts through SDPA (cpu_paged.py);
- `gather`: plain PyTorch, pages gathered per step for SDPA (gather.py);
- `triton` (the GPU default): the paged Triton kernels (triton_paged.py).
"""

from __future__ import annotations

import torch

from ....errors import BadInput
from .capabilities import Capabilities

__all__ = ["Capabilities", "make_backend"]


def make_backend(name: str, num_heads: int, kv_spec, device: torch.device):
    """The attention backend for `engine.attention`, chosen once: auto is triton on CUDA, torch elsewhere. `torch`
    is the C++ paged decode, a CPU kernel: on another device it is a bad job; where it cannot be built on the
    CPU (no compiler) gather runs, with the build's warning. `kv_spec`: the kv_cache.KVCacheSpec (page size, dtype, each
    group's KV heads and head dims). A shape the Triton kernels do not take is a bad job here, at load, not an
    error in every row."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    page_size, shapes = kv_spec.page_size, kv_spec.groups.shapes
    if name == "triton":
        import batchrun_kernels

        from .triton_paged import TritonAttention

        gqa = tuple(num_heads // s.num_kv_heads for s in shapes)
        for shape, g in zip(shapes, gqa):
            why = batchrun_kernels.unsupported_reason(
                kv_spec.dtype, page_size, shape.head_dim, shape.v_head_dim, g
            )
            if why:
                raise BadInput(
                    f"key `engine.attention`: triton cannot run this model: {why}; use attention: gather"
                )
        return TritonAttention(gqa, device)
    from .gather import GatherAttention

    if name == "torch":
        if device.type != "cpu":
            raise BadInput(
                f"key `engine.attention`: torch is batchrun's C++ decode, a CPU kernel; on {device} use triton "
                "or gather"
            )
        from ... import cpu_kernels
        from .cpu_paged import TorchAttention

        kernel = cpu_kernels.load()
        if kernel is not None:
            return TorchAttention(page_size, kernel)  # else cpu_kernels.load warned why
    return GatherAttention(page_size, device)
