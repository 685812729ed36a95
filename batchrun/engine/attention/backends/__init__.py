"""The attention backends, behind one registry. Each is an `AttentionBackend` (base.py) declaring what it computes
beyond paged causal attention (`Capabilities`): the engine asks a capability, never a backend's name. The
registry itself, each backend's name and class in the order `auto` tries them, is engine/backend_registry.py
(torch-free, so the job file's check of `engine.attention` reads the same names); `BACKENDS` is its classes.
Adding a backend is its module and its line there.

- `triton` (CUDA): the paged Triton kernels (triton_paged.py; batchrun_kernels imported only once it is asked);
- `torch` (CPU): decodes through batchrun's C++ kernel, bf16 prompts through its prompt kernel where it applies,
  the others through SDPA (cpu_paged.py, prompt_kernel.py);
- `gather` (anywhere): plain PyTorch, pages gathered per step for SDPA (gather.py).
"""

from __future__ import annotations

import importlib

import torch

from batchrun.engine.attention.backends.base import AttentionBackend, AttentionLayers
from batchrun.engine.attention.backends.capabilities import Capabilities
from batchrun.engine.backend_registry import REGISTRY
from batchrun.errors import BadInput

__all__ = ["BACKENDS", "AttentionBackend", "AttentionLayers", "Capabilities", "make_backend"]


def _registered() -> tuple[type[AttentionBackend], ...]:
    """The registry's classes, in its order, each given its registered name (its value of `engine.attention`)."""
    found = []
    for name, where in REGISTRY.items():
        module, _, cls_name = where.rpartition(".")
        backend = getattr(importlib.import_module(f".{module}", __name__), cls_name)
        backend.name = name
        found.append(backend)
    return tuple(found)


# in the order `auto` tries them: the first that runs on the device and supports the model is chosen
BACKENDS: tuple[type[AttentionBackend], ...] = _registered()


def make_backend(name: str, layers: AttentionLayers, device: torch.device) -> AttentionBackend:
    """The attention backend for `engine.attention`, chosen once: the one named, or for auto the first of
    BACKENDS whose capabilities list the device and which supports the model. A named one that does not is a bad
    job here, at load, naming the reason and the backends that would run it, not an error in every row. One that
    cannot be built on this machine (torch without a compiler: cpu_kernels warned why) gives way to the next of
    BACKENDS that supports the model."""
    by_name = {b.name: b for b in BACKENDS}
    if name == "auto":
        chosen = (
            b for b in BACKENDS if b.capabilities.runs_on(device) and b.supports(layers, device) is None
        )
    elif name not in by_name:
        raise BadInput(f"key `engine.attention`: {name!r} is none of auto, {', '.join(by_name)}")
    else:
        asked = by_name[name]
        why = asked.supports(layers, device)
        if why:
            others = [b.name for b in BACKENDS if b is not asked and b.supports(layers, device) is None]
            instead = f"; use attention: {' or '.join(others)}" if others else ""
            raise BadInput(
                f"key `engine.attention`: {name} cannot run this model on {device}: {why}{instead}"
            )
        later = BACKENDS[BACKENDS.index(asked) + 1 :]
        chosen = (b for b in (asked, *later) if b is asked or b.supports(layers, device) is None)
    for backend in chosen:
        made = backend.create(layers, device)
        if made is not None:
            return made
    reasons = "; ".join(f"{b.name}: {b.supports(layers, device)}" for b in BACKENDS)
    raise BadInput(f"key `engine.attention`: no attention backend runs this model on {device} ({reasons})")
