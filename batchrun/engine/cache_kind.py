"""What a sequence holds in the cache beside its pages, as one protocol (vLLM v1's KV cache spec and manager of a
kind other than full attention: `MambaSpec` and its manager beside `FullAttentionSpec`'s).

Pages are first-class: every model has them, and the scheduler's hot decode path asks the block manager for them
itself (block_manager.py). Anything else a sequence holds (a hybrid model's state slots: state_kind.py) is a
*kind*: one module declaring a `CacheKind` subclass, listed in cache_kinds.py (what a new kind still needs
beside: docs/ARCHITECTURE.md, "Where a new piece goes"). The load probe finds it through the kind (`probe`: a
`KindProbe` in the probe forward's views, its `KindSpec` held in the model plan by kind), and it brings two
halves, made once per engine from the model plan:

- its manager (`KindManager`): pure integers, like the block manager. The KV cache coordinator
  (kv_coordinator.py) calls every kind's manager in each of its actions (admit, fork, finish, swap, ...), and
  files the copies a manager returns (`KindCopy`) into that kind's share of the plan (`KindCopies`);
- its tensors (`KindTensors`): what the plan's copies move, applied by the engine before the step, and what a
  step's view of them is for the layers that read them (the runner builds it from the plan each step).

The kind itself (`CacheKind`) is found from the model plan (`of`), takes its share of the memory budget
(`pool`: sizing.pool_sizes asks it) and builds both halves. Its usage is a typed record: the class names its
columns once (`usage_columns`, a `UsageColumns`), its manager counts them (`usage`, a `Usage`), and the memory
snapshot (memory.py), the statistics' rows and summary (stats.py) and the report (report.py) derive everything
they show of the kind from those two. A kind's module imports torch only inside the methods that make tensors
or probe the model: `batchrun stats` reads the registered kinds' columns without torch (tests/test_docs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple


class UsageColumns(NamedTuple):
    """What the statistics show of a kind, named once in its class (`CacheKind.usage_columns`): its units there
    are and those the running sequences hold, a column each of every step's row, and its bytes per unit. The
    summary reads each by its role: `total` at the run's end (under its own name), `used` at its most over the
    steps (`peak`), `bytes_per_unit` as the kind has it (`CacheKind.bytes_per_unit`); stats.py says how
    summaries of shards and runs combine each role."""

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
    """A kind's usage now, as its manager counts it (`KindManager.usage`): its `UsageColumns`' two columns."""

    total: int
    used: int


def usage_row(kinds, managers, running, recount: bool = False) -> dict[str, int]:
    """Each kind's usage columns by name (a memory snapshot's `usage`): `kinds` the engine's `CacheKind`s and
    `managers` theirs, in one order; `recount`: each manager counts sequence by sequence."""
    row = {}
    for kind, manager in zip(kinds, managers, strict=True):
        columns, usage = kind.usage_columns, manager.usage(running, recount)
        row[columns.total], row[columns.used] = usage
    return row


class KindCopy(NamedTuple):
    """One copy of a kind's unit (a state slot: every stateful layer's states) from `src` to `dst`."""

    src: int
    dst: int


@dataclass(eq=False, slots=True)
class KindCopies:
    """One kind's copies in one plan, in the only safe order: within the device first (a fork's, a kept
    prefix's taken or restored: from units still held), then out to the CPU, then in from it. Which kind's: its
    place in the plan's `kind_copies` (the coordinator's order of managers, which is the engine's of kinds)."""

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

    def unit_of(self, seq) -> int:
        """The unit a running sequence's step reads (-1: none): its place in ScheduledSequence.units."""
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

    def usage(self, running, recount: bool = False) -> Usage:
        """The units there are and those the running sequences hold (its kind's `usage_columns`), counted by the
        manager, or (`recount`) sequence by sequence to prove the first."""
        return Usage(0, 0)


class KindSpec:
    """What the load probe found of a kind in a model (a hybrid's `StateSpec`): held in the model plan under the
    kind's class (`ModelPlan.kind_specs`), from which the kind is made (`CacheKind.of`)."""

    @property
    def layer_indices(self) -> tuple[int, ...]:
        """The layers that keep this kind's units (a decoder layer doing only that is not silent to the probe)."""
        return ()

    @property
    def whole_prompts(self) -> bool:
        """Each prompt must be computed in one step (a layer that cannot continue over several tokens)."""
        return False


class KindProbe:
    """The load probe's stand-in for a kind's step view (architecture.inspect_model): placed in the probe
    forward's `AttentionMetadata.views` under `view_key`, where the kind's layers look for their view (the kind's
    tensors' class), so the model's own code reveals what it keeps; `spec` afterwards says what that was."""

    view_key: type

    def spec(self, measured: bool = True) -> KindSpec | None:
        """What the forward found (None: nothing of this kind). `measured` False: the probe ran on the meta
        device (shapes, no numbers to compare)."""
        raise NotImplementedError


class KindTensors:
    """The tensor half of a kind: what its copies move, and a step's view of it for the layers."""

    def apply(self, copies: KindCopies) -> None:
        """A plan's copies of this kind, in their order (before the step's forward)."""

    def step_view(self, units: list[int], query_lens: list[int], starts: list[int]) -> Any:
        """What the layers read of this kind in one step: per scheduled sequence in packed order, this kind's
        unit (its manager's `unit_of`), its tokens this step and where they start."""
        return None


class CacheKind:
    """A kind of what a sequence holds beside its pages: found from the model plan, sized from the KV budget,
    and the maker of its manager and tensors. A subclass overrides all of these; the engine makes one per model
    that has the kind (`of`), and the runner hands its tensors' step view to the layers in
    `AttentionMetadata.views`, keyed by the tensors' class."""

    usage_columns: UsageColumns  # what the statistics show of it (0 for a model without the kind)

    @property
    def bytes_per_unit(self) -> int:
        """One unit's bytes, for the run's summary (`usage_columns.bytes_per_unit`)."""
        raise NotImplementedError

    @classmethod
    def probe(cls, model) -> KindProbe | None:
        """The load probe's stand-in for this kind's view (and the model's modules made ready for it, refusing
        what cannot run); None: the probe's forward does not look for this kind."""
        return None

    @classmethod
    def of(cls, plan) -> CacheKind | None:
        """This kind for the model of `plan` (model_plan.ModelPlan: its probe's spec, `plan.kind_specs`); None:
        the model holds none of it."""
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
