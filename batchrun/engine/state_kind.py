"""The state kind: a hybrid model's state slots as one `CacheKind` (cache_kind.py), the one kind beside pages.

Its parts live in their own modules: the spec the load probe finds (`StateSpec`, state_cache.py), the manager of
which slot each sequence holds (`StateSlots`, state_slots.py: pure integers) and the slot tensors with a step's
view of them (`StateCache`, `StepStates`, state_cache.py). This module says how the engine finds the kind in the
model plan, what share of the KV budget it takes, and how its halves are made from that share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import BadInput
from .cache_kind import CacheKind, UsageColumns
from .state_slots import StateSlots

if TYPE_CHECKING:  # torch only where tensors are made: `batchrun stats` reads this class's columns without it
    import torch

    from .state_cache import StateCache, StateProbe, StateSpec

MAX_SNAPSHOTS = 16  # shared prefixes whose state a hybrid keeps at once: a job has few system prompts


@dataclass(frozen=True)
class StatePool:
    """The state slots: for running sequences and, with prefix sharing, for kept prefixes (snapshots), on the
    device; CPU slots for swapped sequences; and the bytes they take of the KV budget and the swap space."""

    num_slots: int
    num_cpu_slots: int
    num_snapshots: int
    device_bytes: int
    cpu_bytes: int


class StateKind(CacheKind):
    """A hybrid model's per-sequence states (linear attention, Mamba, short convolutions): one slot a running
    sequence (and one reserved per sample it will fork), a CPU slot a swapped one, a few more keeping the states
    at shared prefixes' ends."""

    usage_columns = UsageColumns(
        "state_slots_total", "state_slots_used", "bytes_per_state_slot", "state slots", "hybrid layers"
    )

    def __init__(self, spec: StateSpec):
        self.spec = spec

    @classmethod
    def probe(cls, model) -> StateProbe:
        """The model's stateful modules routed to the step's slots (refusing one batchrun cannot give a slot),
        and the probe recording what they keep."""
        from .state_cache import StateProbe
        from .stateful_layers import prepare_stateful_layers, stateful_modules

        prepare_stateful_layers(stateful_modules(model))
        return StateProbe()

    @classmethod
    def of(cls, plan) -> StateKind | None:
        """The plan's states (the load probe's StateSpec); None: no stateful layers."""
        spec = plan.kind_specs.get(cls)
        return cls(spec) if spec is not None else None

    @property
    def bytes_per_unit(self) -> int:
        return self.spec.bytes_per_slot

    def pool(self, config, budget: int | None, swap: int, bytes_per_page: int, num_groups: int) -> StatePool:
        """The budget split by what the scheduler needs: a running sequence holds one state slot and at least one
        page per KV cache group, and at most `max_num_seqs` sequences run at once. So there are `max_num_seqs`
        slots (fewer where the budget cannot hold that many slots with a page per group each, or where they would
        take more than half of it), and the rest of the budget is pages. With prefix sharing, a few more slots (a
        quarter as many, at most MAX_SNAPSHOTS) keep shared prefixes' states. The swap space is split the same
        way. An explicit `engine.num_pages` (`budget` None) is the pages alone; the slots then come on top."""
        bytes_per_slot = self.spec.bytes_per_slot
        per_seq = bytes_per_slot + num_groups * bytes_per_page
        cpu_slots = min(config.max_num_seqs, swap // per_seq)
        # False: the layers cannot start from a kept state
        keeps = config.prefix_sharing and self.spec.continues_state
        snapshots = lambda slots: min(MAX_SNAPSHOTS, max(1, slots // 4)) if keeps else 0
        if budget is None:
            slots = config.max_num_seqs
            kept = snapshots(slots)
        else:
            # at most half the budget in slots: at a small budget, slots for max_num_seqs would leave too few
            # pages for them (one page each is no sequence's length), and sequences at once would be bounded by
            # pages anyway
            slots = min(config.max_num_seqs, budget // per_seq, max(1, budget // 2 // bytes_per_slot))
            if slots < 1:
                raise BadInput(
                    f"key `engine.kv_cache_memory`: {config.kv_cache_memory!r} holds no sequence of this hybrid "
                    f"model (a state slot of {bytes_per_slot} bytes and {num_groups} KV page(s) of "
                    f"{bytes_per_page} bytes); give more memory or set engine.num_pages."
                )
            fits = budget >= (slots + snapshots(slots)) * bytes_per_slot + bytes_per_page
            kept = snapshots(slots) if fits else 0
        return StatePool(slots, cpu_slots, kept, (slots + kept) * bytes_per_slot, cpu_slots * bytes_per_slot)

    def manager(self, pool: StatePool) -> StateSlots:
        return StateSlots(pool.num_slots, pool.num_cpu_slots, pool.num_snapshots)

    def tensors(self, pool: StatePool, device: torch.device) -> StateCache:
        from .state_cache import StateCache

        return StateCache(self.spec, pool.num_slots + pool.num_snapshots, pool.num_cpu_slots, device)
