"""What a sequence holds in the cache beside its pages, as one protocol (vLLM v1's KV cache spec and manager of a
kind other than full attention: `MambaSpec` and its manager beside `FullAttentionSpec`'s).

Pages are first-class: every model has them, and the scheduler's hot decode path asks the block manager for them
itself (block_manager.py). Anything else a sequence holds (a hybrid model's state slots: state_kind.py) is a
*kind*: one module declaring a `CacheKind` subclass, listed in cache_kinds.py (what else still names the one
kind there is: docs/ARCHITECTURE.md, "Where a new piece goes"). A kind brings two halves, made once per engine
from the model plan:

- its manager (`KindManager`): pure integers, like the block manager. The KV cache coordinator
  (kv_coordinator.py) calls every kind's manager in each of its actions (admit, fork, finish, swap, ...), and
  files the copies a manager returns (`KindCopy`) into that kind's share of the plan (`KindCopies`);
- its tensors (`KindTensors`): what the plan's copies move, applied by the engine before the step, and what a
  step's view of them is for the layers that read them (the runner builds it from the plan each step).

The kind itself (`CacheKind`) is found from the model plan (`of`), takes its share of the memory budget
(`pool`: sizing.pool_sizes asks it) and builds both halves; its manager counts its usage columns (`usage`:
memory.py's snapshot, stats.py's rows) and the kind gives the run's summary its fixed figures (`summary`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple


class KindCopy(NamedTuple):
    """One copy of a kind's unit (a state slot: every stateful layer's states) from `src` to `dst`."""

    src: int
    dst: int


@dataclass(eq=False, slots=True)
class KindCopies:
    """One kind's copies in one plan, in the only safe order: within the device first (a fork's, a kept
    prefix's taken or restored: from units still held), then out to the CPU, then in from it. `kind`: the
    manager that made them (the coordinator's order of kinds, which is the engine's)."""

    kind: Any  # a KindManager
    device: list[KindCopy] = field(default_factory=list)
    swap_out: list[KindCopy] = field(default_factory=list)
    swap_in: list[KindCopy] = field(default_factory=list)


class KindManager:
    """The pure-integer half of a kind: which units each sequence holds. The coordinator calls every kind's
    manager in each action, after the block manager; a copy returned (None: nothing to copy) is filed into the
    plan that makes it (`device`, `swap_out`, `swap_in` of the kind's `KindCopies`). The defaults are a kind that
    keeps nothing per prefix and never cuts a step."""

    # seq_id -> the full pages (a count) where its next step must stop (a prefix whose content the kind keeps);
    # the scheduler asks it of every running sequence, every step. None: this kind never cuts a step
    step_ends: dict[int, int] | None = None

    def new_step(self) -> None:
        """A plan begins."""

    # ---- admission
    def admission_error(self, num_samples: int) -> str | None:
        """Why a request of `num_samples` parallel samples can never run with this kind's units, or None."""
        return None

    def usable(self, hashes: list[bytes], k: int) -> bool:
        """A cached prefix of k pages is usable: this kind holds what a sequence needs at its end."""
        return True

    def admission_waits(self, hashes: list[bytes], matched: int) -> bool:
        """A longer prefix of these pages than `matched` is being kept this step: admission waits one step."""
        return False

    def can_admit(self, seq) -> bool:
        """Free units for seq (and for the samples it will fork)."""
        return True

    def keep_prefix(self, seq, hashes: list[bytes], matched: int, page_hashes, waiting) -> None:
        """Choose the prefix of seq worth keeping (`page_hashes(o)` of each of the next `waiting` prompts)."""

    def admit(self, seq, hashes: list[bytes], matched: int) -> KindCopy | None:
        """seq's units; returns the copy of what is kept at its cached prefix's end into them (this plan)."""
        return None

    # ---- running
    def limit(self, seq, start: int, n: int, page_size: int) -> int:
        """n, or fewer: where seq's step must stop (`step_ends`)."""
        return n

    def planned(self, seq, end: int, page_size: int, page_hashes) -> KindCopy | None:
        """seq is planned up to `end` tokens; returns a copy the next plan makes (after this step computed its
        source). Asked only for a sequence listed in the cutting kind's `step_ends` (KVCacheCoordinator.planned)."""
        return None

    def fork(self, parent, child) -> KindCopy | None:
        """A parallel sample: the copy of its parent's units into its own (the next plan's)."""
        return None

    def slot_of(self, seq) -> int:
        """The unit a running sequence's step reads (-1: none)."""
        return -1

    # ---- leaving
    def free(self, seq) -> None:
        """seq gives back its accelerator units (finished, preempted, recomputed)."""

    def free_cpu(self, seq) -> None:
        """A swapped sequence gives back its CPU units (aborted)."""

    def abort(self) -> None:
        """Every request is dropped: nothing pending stays."""

    # ---- swapping
    def can_swap_out(self, seq) -> bool:
        return True

    def swap_out(self, seq) -> KindCopy | None:
        return None

    def can_swap_in(self, seq) -> bool:
        return True

    def swap_in(self, seq) -> KindCopy | None:
        return None

    # ---- checks and usage
    def check(self, running: list, swapped: list) -> None:
        """Every unit free or held by exactly the sequences that should hold it (AssertionError otherwise)."""

    def usage(self, running, recount: bool = False) -> dict[str, int]:
        """This kind's columns of a memory snapshot (memory.MemorySnapshot's fields): totals and units in use,
        counted by the manager, or (`recount`) sequence by sequence to prove the first."""
        return {}


class KindTensors:
    """The tensor half of a kind: what its copies move, and a step's view of it for the layers."""

    def apply(self, copies: KindCopies) -> None:
        """A plan's copies of this kind, in their order (before the step's forward)."""

    def step_view(self, scheduled: list, query_lens: list[int], starts: list[int]) -> Any:
        """What the layers read of this kind in one step (the plan's scheduled sequences, in packed order)."""
        return None


class CacheKind:
    """A kind of what a sequence holds beside its pages: found from the model plan, sized from the KV budget,
    and the maker of its manager and tensors. A subclass overrides all of these; the engine makes one per model
    that has the kind (`of`), and the runner hands its tensors' step view to the layers in
    `AttentionMetadata.views`, keyed by the tensors' class."""

    summary_keys: tuple[str, ...] = ()  # the keys of `summary` (0 in the summary of a model without the kind)

    @property
    def summary(self) -> dict[str, int]:
        """The kind's fixed figures for the run's summary (stats.py, through Engine.kind_summary)."""
        return {}

    @classmethod
    def of(cls, plan) -> CacheKind | None:
        """This kind for the model of `plan` (model_plan.ModelPlan); None: the model holds none of it."""
        raise NotImplementedError

    def pool(self, config, budget: int | None, swap: int, bytes_per_page: int, num_groups: int) -> Any:
        """This kind's pool sizes from the KV budget in bytes (None: `engine.num_pages` fixes the pages, and the
        kind comes on top) and the swap space in bytes; the pool has `device_bytes` and `cpu_bytes`, what it
        takes of each (the rest is pages)."""
        raise NotImplementedError

    def manager(self, pool) -> KindManager:
        raise NotImplementedError

    def tensors(self, pool, device) -> KindTensors:
        raise NotImplementedError
