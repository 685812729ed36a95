"""What the cache holds, as typed records that both sides of the engine read: the specs the load probe finds (the
pages' KV groups and shapes, a hybrid's per-sequence states) and the copies a plan carries between units (pages,
state slots). The scheduler's side (kv_coordinator.py and its managers) and the runner's side (kv_cache.py,
state_cache.py: the tensors) both import this module, and it imports nothing of the engine, nor torch (a dtype
is only read for its `itemsize`): `batchrun stats` reads the state manager's columns without torch.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch


# ---- the pages ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVShape:
    """One attention layer's K/V per token (MLA models such as DeepSeek-V3 have wider keys than values)."""

    num_kv_heads: int
    head_dim: int  # of the keys (and queries)
    v_head_dim: int  # of the values (MLA: narrower than the keys)

    @property
    def elements(self) -> int:
        """K and V elements per token."""
        return self.num_kv_heads * (self.head_dim + self.v_head_dim)


@dataclass(frozen=True)
class KVGroups:
    """The attention layers in KV cache groups: one mask (full, a sliding window, chunks: attention.MaskKind) and
    one K/V shape per group, so that a group's pages follow one block table and one view per layer. Layers of one
    mask and shape are split into groups of `base` layers, `base` the gcd of the counts of each (mask, shape), so
    that every group of the common shape fills a page; a group of a smaller shape takes as many layers as fit the
    page (gpt-oss's alternating 12 : 12 is 2 groups of 12; Gemma 3's 5 : 1 over 6 layers, 6 groups of 1)."""

    mask_kinds: tuple[Hashable, ...]  # per group: its mask (attention.MaskKind)
    shapes: tuple[KVShape, ...]  # per group
    sizes: tuple[int, ...]  # per group: its layers
    layer_group: tuple[int, ...]  # per layer: its group (-1: a layer without attention)
    layer_slot: tuple[int, ...]  # per layer: its place among its group's layers (in the page)
    # layers handed an earlier layer's very K/V (KV sharing): they read that layer's place, and write nothing
    readers: frozenset[int] = frozenset()

    @property
    def num_groups(self) -> int:
        return len(self.mask_kinds)

    @property
    def elements_per_token(self) -> int:
        """A page's K/V elements per token: its largest group's."""
        return max(n * s.elements for s, n in zip(self.shapes, self.sizes))

    @classmethod
    def of_layers(
        cls, layers: list[tuple[Hashable, KVShape] | None], reads: dict[int, int] | None = None
    ) -> KVGroups:
        """Groups of the attention layers, each given as (mask, K/V shape); None: a layer without attention, in no
        group. `reads`: layer -> the earlier layer whose K/V it attends over, of its mask and shape (Gemma 3n's
        and 4's KV-shared layers): it gets that layer's place in the pages, not pages of its own."""
        reads = reads or {}
        by_key: dict[tuple[Hashable, KVShape], list[int]] = {}
        for layer, key in enumerate(layers):
            if key is not None and layer not in reads:
                by_key.setdefault(key, []).append(layer)
        base = math.gcd(*(len(members) for members in by_key.values()))
        width = max(base * shape.elements for _, shape in by_key)  # a page's elements per token
        masks, shapes, sizes = [], [], []
        layer_group, layer_slot = [-1] * len(layers), [-1] * len(layers)
        for (mask, shape), members in by_key.items():
            size = width // shape.elements
            for i in range(0, len(members), size):
                chunk = members[i : i + size]
                for slot, layer in enumerate(chunk):
                    layer_group[layer], layer_slot[layer] = len(masks), slot
                masks.append(mask)
                shapes.append(shape)
                sizes.append(len(chunk))
        for layer, source in reads.items():
            assert layers[layer] == layers[source], "a layer reads the K/V of a layer of its mask and shape"
            layer_group[layer], layer_slot[layer] = layer_group[source], layer_slot[source]
        return cls(
            tuple(masks), tuple(shapes), tuple(sizes), tuple(layer_group), tuple(layer_slot), frozenset(reads)
        )


@dataclass(frozen=True)
class KVCacheSpec:
    """The pages: their size in tokens, their dtype, and the groups whose layers they hold."""

    groups: KVGroups
    page_size: int
    dtype: torch.dtype

    @property
    def page_elements(self) -> int:
        return self.page_size * self.groups.elements_per_token

    @property
    def bytes_per_page(self) -> int:
        return self.page_elements * self.dtype.itemsize


# ---- a hybrid's states ----------------------------------------------------------------------------------------
class StateShape(NamedTuple):
    shape: tuple[int, ...]  # of one sequence's state, without the batch axis
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class LayerStates:
    """One stateful layer's states, by state index (`state_idx` of transformers' cache interface)."""

    layer: int
    conv: tuple[StateShape | None, ...]
    recurrent: tuple[StateShape | None, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in (*self.conv, *self.recurrent) if s is not None)


@dataclass(frozen=True)
class StateSpec:
    """What one state slot holds: every stateful layer's states (linear attention, Mamba, short convolutions),
    as the load probe found the model's own code create them (state_cache.StateProbe)."""

    layers: tuple[LayerStates, ...]
    # whether every stateful layer's several-token (prompt) form continues the state it is given; where one
    # starts afresh instead (Jamba's Mamba scan takes no initial state: `generate` only ever runs it on a whole
    # prompt), each prompt runs whole in one step and no prefix state is kept for sharing
    continues_state: bool = True

    @property
    def bytes_per_slot(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def layer_indices(self) -> tuple[int, ...]:
        return tuple(layer.layer for layer in self.layers)


# ---- the plan's copies ----------------------------------------------------------------------------------------
class PageCopy(NamedTuple):
    src: int
    dst: int


class UnitCopy(NamedTuple):
    """One copy of a manager's unit (a state slot: every stateful layer's states) from `src` to `dst`."""

    src: int
    dst: int


@dataclass(eq=False, slots=True)
class UnitCopies:
    """One manager's copies in one plan, in the only safe order: within the device first (a fork's, a kept
    prefix's taken or restored: from units still held), then out to the CPU, then in from it. Whose: its place
    in the plan's `unit_copies` (the coordinator's order of managers, which is the engine's of its tensors)."""

    device: list[UnitCopy] = field(default_factory=list)
    swap_out: list[UnitCopy] = field(default_factory=list)
    swap_in: list[UnitCopy] = field(default_factory=list)


# ---- what the statistics show of a manager's units ---------------------------------------------------------------
class UsageColumns(NamedTuple):
    """What the statistics show of a manager's units, named once in its class (`CacheManager.usage_columns`): the
    units there are and those the running sequences hold, a column each of every step's row, and their bytes
    per unit. The summary reads each by its role: `total` at the run's end (under its own name), `used` at its
    most over the steps (`peak`), `bytes_per_unit` as the engine has it; stats.py says how summaries of shards
    and runs combine each role."""

    total: str  # a row's column: the units there are ("state_slots_total")
    used: str  # a row's column: the units the running sequences hold ("state_slots_used")
    bytes_per_unit: str  # a summary key ("bytes_per_state_slot")
    label: str  # what the report and the plot call the units ("state slots")
    holder: str  # what holds them, for the report ("hybrid layers")

    @property
    def peak(self) -> str:
        """The summary's key of `used` at its most over the steps."""
        return f"peak_{self.used}"


class Usage(NamedTuple):
    """A manager's usage now (`CacheManager.usage`): its `UsageColumns`' two columns."""

    total: int
    used: int
