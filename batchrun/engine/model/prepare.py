"""The one ordered registry of the rewrites batchrun makes to a loaded model before its first step, and the one
`prepare_model` that generation (llm.LLM), pooling (pooling.PoolingRunner) and bench/host.py call.

Each rewrite keeps its own module (its kernels and its form checks: a module is rewritten only where it is a form
that module knows); here is only whether it applies to a job, in what order, and how it is undone. The order is
the one place it is written, because each rewrite reads what the one before it left:
- LoRA wraps its target layers first, so that packing then packs their base layers (lora/layers.py);
- packing makes the fused q/k/v and gate/up products and packs the other linear layers (cpu_linear.py);
- a BERT-style block's GELU and residual add become post-ops of its packed products (fused_encoder.py: bf16/fp16
  only, its post-ops are not HF's operations bit for bit in fp32);
- RMSNorms (and in bf16/fp16 SiLU-gated MLPs, reading a fused gate/up product whole) by C++ (fused_elementwise.py);
- `apply_rotary_pos_emb` by C++ within the runner's forward (fused_rotary.py);
- a decoder layer's residual adds in place, the first with a fused post-attention norm (fused_residual.py).
Every rewrite but LoRA is a CPU one. Where a rewrite has no undo: LoRA's and packing's float weights are let go
(undoing would mean loading them again), and fused_rotary's function is the modeling module's, shared by every
model of that file and HF's own outside the runner's forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from batchrun.engine.model.lora import layers as lora
from batchrun.engine.model.ops import (
    cpu_allocator,
    cpu_linear,
    fused_elementwise,
    fused_encoder,
    fused_linear,
    fused_residual,
    fused_rotary,
)


@dataclass(frozen=True)
class Preparation:
    """What a job asks of its model's preparation: where and in what dtype it runs, whether its linear weights
    may be packed (engine.pack_weights), and its LoRA adapters ({name: (folder, config)}: adapters.read_adapters)
    with the engine's max_loras."""

    device: torch.device
    dtype: torch.dtype
    pack_weights: bool = True
    adapters: dict = field(default_factory=dict)
    max_loras: int = 1

    @property
    def cpu(self) -> bool:
        return self.device.type == "cpu"


@dataclass(frozen=True)
class Rewrite:
    """One rewrite: whether it applies to a job, its install (returns how many modules it rewrote) and its undo
    (returns how many it put back; None: it has none, the module docstring says why)."""

    name: str
    applies: Callable[[Preparation], bool]
    install: Callable[[torch.nn.Module, Preparation], int]
    undo: Callable[[torch.nn.Module], int] | None = None


REWRITES = (
    Rewrite(
        "lora",
        lambda c: bool(c.adapters),
        lambda m, c: len(lora.attach(m, c.adapters, c.max_loras, c.device).names),
    ),
    Rewrite(
        "packed_linear",
        lambda c: c.cpu and c.pack_weights and cpu_linear.available(c.dtype),
        lambda m, c: cpu_linear.pack_linear_layers(m),
    ),
    Rewrite(
        "fused_encoder",
        lambda c: c.cpu and c.dtype != torch.float32,
        lambda m, c: fused_encoder.fuse(m),
        fused_encoder.restore,
    ),
    Rewrite(
        "fused_elementwise",
        lambda c: c.cpu,
        lambda m, c: fused_elementwise.fuse(m, c.dtype),
        fused_elementwise.restore,
    ),
    Rewrite("fused_rotary", lambda c: c.cpu, lambda m, c: fused_rotary.install(m)),
    Rewrite(
        "fused_residual", lambda c: c.cpu, lambda m, c: fused_residual.install(m), fused_residual.restore
    ),
)


def prepare_model(model: torch.nn.Module, context: Preparation) -> dict[str, int]:
    """Every rewrite of `REWRITES` that applies to `context`, in order; returns how many modules each rewrote
    (0: it did not apply, or found nothing of a form it knows), and `fused_products`: how many of the packed
    products are fused sibling groups (q/k/v, gate/up). On the CPU, freed memory blocks are kept for reuse
    from here on (cpu_allocator)."""
    if context.cpu:
        cpu_allocator.keep_freed_blocks()
    counts = {r.name: r.install(model, context) if r.applies(context) else 0 for r in REWRITES}
    counts["fused_products"] = len(fused_linear.fused_groups(model))
    return counts


def undo(model: torch.nn.Module) -> int:
    """Undo every rewrite that has an undo, last installed first; returns how many modules were put back (the
    step profiler compares a model with and without them)."""
    return sum(r.undo(model) for r in reversed(REWRITES) if r.undo is not None)
