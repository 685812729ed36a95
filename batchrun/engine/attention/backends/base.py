"""What every attention backend is: a class with a name and its capabilities, which says whether it runs a model
on a device (`supports`), builds a plan per step and KV cache group (its metadata builder), and attends a layer's
call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from batchrun.engine.attention.backends.capabilities import Capabilities
from batchrun.engine.attention.layers import LayerCall, LayerSpec
from batchrun.engine.attention.metadata import AttentionMetadata, GroupMetadata, StepMetadata


@dataclass(frozen=True)
class AttentionLayers:
    """A model's attention as a backend sees it at load: the query heads, the pages (kv_cache.KVCacheSpec: page
    size, dtype, each group's KV heads and head dims) and each layer's spec (None: a layer without attention)."""

    num_heads: int
    kv_spec: Any
    specs: tuple[LayerSpec | None, ...]

    @property
    def gqa(self) -> tuple[int, ...]:
        """Query heads per KV head, per KV cache group."""
        return tuple(self.num_heads // s.num_kv_heads for s in self.kv_spec.groups.shapes)


class AttentionMetadataBuilder:
    """A backend's plans for one step (vLLM v1's per-backend metadata builders): made once per step while the
    step is prepared (engine/worker/model_runner.py), from the step and its KV cache groups; what several groups share
    (a mask kind's masks, a grid mapping) is built in `__init__`, once, as named fields of the subclass; then
    `build(group)` once per group makes that group's plan, which the backend's `forward` gets back as
    `meta.plans[spec.group]`. Nothing is built in the forward, and nothing is looked up by a string key."""

    def __init__(self, backend: Any, step: StepMetadata, groups: list[GroupMetadata]):
        self.backend = backend
        self.step = step

    def build(self, group: GroupMetadata) -> Any:
        raise NotImplementedError


class AttentionBackend:
    """An attention backend. `build(step, groups) -> plans` is called once per step while the step is prepared
    (engine/worker/model_runner.py), through the backend's `builder`; `forward(meta, spec, call, q, k, v, scale) ->
    out [T, Hq, Dv]` by every attention layer, with the plan of its group (`meta.plans[spec.group]`)."""

    name: ClassVar[str]  # its value of `engine.attention`, given by the registry (engine/backend_registry.py)
    capabilities: ClassVar[Capabilities]
    builder: ClassVar[type[AttentionMetadataBuilder]]  # what it needs for a step, per KV cache group

    @classmethod
    def supports(cls, layers: AttentionLayers, device: torch.device) -> str | None:
        """Why this backend cannot run the model on the device (None: it can), asked once, at load."""
        if not cls.runs_on(device):
            return f"it runs on {' or '.join(cls.capabilities.devices)}, not {device.type}"
        dtypes = cls.capabilities.dtypes
        if dtypes is not None and layers.kv_spec.dtype not in dtypes:
            return f"pages of {layers.kv_spec.dtype}; it takes {', '.join(map(str, dtypes))}"
        shapes = layers.kv_spec.groups.shapes
        for spec in layers.specs:
            if spec is not None:
                shape = shapes[spec.group]
                why = cls.capabilities.lacks(spec, shape.head_dim, shape.v_head_dim)
                if why:
                    return why
        return cls.unsupported_shape(layers)

    @classmethod
    def runs_on(cls, device: torch.device) -> bool:
        """Whether it can be asked for on this device (its capabilities' devices; `auto` reads only those)."""
        return cls.capabilities.runs_on(device)

    @classmethod
    def unsupported_shape(cls, layers: AttentionLayers) -> str | None:
        """Why the backend's kernels do not take the model's shapes (dtype, page size, head dims); None: they do."""
        return None

    @classmethod
    def create(cls, layers: AttentionLayers, device: torch.device) -> AttentionBackend | None:
        """The backend for this model; None where it cannot be built on this machine (having warned why): the
        next registered backend that supports the model runs instead."""
        raise NotImplementedError

    def build(self, step: StepMetadata, groups: list[GroupMetadata]) -> list[Any]:
        """Each group's plan for this step, in group order (one builder for the step)."""
        builder = self.builder(self, step, groups)
        return [builder.build(g) for g in groups]

    def forward(
        self, meta: AttentionMetadata, spec: LayerSpec, call: LayerCall, q, k, v, scale: float
    ) -> torch.Tensor:
        raise NotImplementedError
