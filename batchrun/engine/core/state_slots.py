"""Which state slot each sequence holds: pure integers, like page_pool.py (state_cache.py holds the tensors).

A hybrid model's running sequence holds one accelerator slot for its stateful layers' states (and one reserved
for each parallel sample it will fork), a swapped one a CPU slot; a few more slots keep the states at the ends of
shared prefixes (snapshots), so that a row behind a shared prefix starts from a copy rather than recomputing it.
`StateSlots` is the state's manager (kv_coordinator.CacheManager): the KV cache coordinator calls it beside the
block manager in each action. A model without stateful layers has no state spec, so the coordinator holds no
such manager. `state_pool` sizes the slots from the KV budget (sizing.pool_sizes asks it).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from itertools import islice

from batchrun.engine.core.cache_spec import StateSpec, UnitCopy, Usage, UsageColumns
from batchrun.engine.core.kv_coordinator import CacheManager
from batchrun.errors import BadInput

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


def state_pool(spec: StateSpec, config, budget: int | None, swap: int, bytes_per_page: int, num_groups: int):
    """The budget split by what the scheduler needs: a running sequence holds one state slot and at least one
    page per KV cache group, and at most `max_num_seqs` sequences run at once. So there are `max_num_seqs` slots
    (fewer where the budget cannot hold that many slots with a page per group each, or where they would take
    more than half of it), and the rest of the budget is pages. With prefix sharing, a few more slots (a quarter
    as many, at most MAX_SNAPSHOTS) keep shared prefixes' states. The swap space is split the same way. An
    explicit `engine.num_pages` (`budget` None) is the pages alone; the slots then come on top."""
    bytes_per_slot = spec.bytes_per_slot
    per_seq = bytes_per_slot + num_groups * bytes_per_page
    cpu_slots = min(config.max_num_seqs, swap // per_seq)
    # False: the layers cannot start from a kept state
    keeps = config.prefix_sharing and spec.continues_state
    snapshots = lambda slots: min(MAX_SNAPSHOTS, max(1, slots // 4)) if keeps else 0
    if budget is None:
        slots = config.max_num_seqs
        kept = snapshots(slots)
    else:
        # at most half the budget in slots: at a small budget, slots for max_num_seqs would leave too few pages
        # for them (one page each is no sequence's length), and sequences at once would be bounded by pages
        # anyway
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


@dataclass(eq=False, slots=True)
class SequenceSlots:
    """What the state slots keep for one sequence: its accelerator slot while it runs (-1: none) and those
    reserved for the samples it will fork, and its CPU slot while swapped out (-1: none). (The prefix whose state
    it is to keep is in `StateSlots.snapshot_ends`.)"""

    slot: int = -1
    reserved: list[int] = field(default_factory=list)
    cpu_slot: int = -1


class StateSlots(CacheManager):
    """The accelerator's and the CPU's state slots: which are free, and which each sequence holds
    (`SequenceSlots`, keyed by seq_id): one slot while it runs (and one reserved for each sample it will fork),
    a CPU slot while it is swapped out.

    Prefix sharing: `num_snapshots` more slots keep the state at the end of a shared prefix (a whole number of
    pages), indexed by the chain hash of the prefix's last page, least recently used first out. A sequence
    admitted behind cached pages starts from a copy of the snapshot at their end; without one it computes the
    prefix (its pages are still shared). Which prefix to keep: at admission, the longest run of pages the
    sequence's prompt shares with a waiting prompt; its prefill stops at that page boundary once, and the state
    there is copied into a snapshot before the next step. A waiting sequence whose prefix is being snapshotted
    this step waits for it (one step) rather than compute it again."""

    LOOKAHEAD = 16  # waiting prompts a newly admitted one is compared with, for a prefix they share
    usage_columns = UsageColumns(
        "state_slots_total", "state_slots_used", "bytes_per_state_slot", "state slots", "hybrid layers"
    )

    def __init__(self, num_slots: int, num_cpu_slots: int, num_snapshots: int = 0, bytes_per_slot: int = 0):
        self.num_slots, self.num_cpu_slots, self.num_snapshots = num_slots, num_cpu_slots, num_snapshots
        self.bytes_per_unit = bytes_per_slot
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._free_cpu: deque[int] = deque(range(num_cpu_slots))
        self._free_snapshots: list[int] = list(range(num_slots + num_snapshots - 1, num_slots - 1, -1))
        self.snapshots: OrderedDict[bytes, int] = OrderedDict()  # prefix's last page hash -> slot, LRU first
        self._taken_now: set[bytes] = set()  # snapshots whose copy is planned: usable from the next step
        self.sequences: dict[int, SequenceSlots] = {}  # seq_id -> what it holds, while it holds anything
        # seq_id -> the prefix (full pages) whose state it keeps when its prefill gets there: the scheduler's
        # chunk rule asks every step (`limit`), so it has a dict of its own
        self.snapshot_ends: dict[int, int] = {}
        self.step_ends = (
            self.snapshot_ends
        )  # the coordinator's and the scheduler's name for it (CacheManager)
        self.snapshots_taken = self.snapshots_restored = 0  # counters for statistics

    # ---- prefix snapshots ----------------------------------------------------------------------------------
    def new_step(self) -> None:
        """A plan begins: the snapshots planned in the previous one are copied first thing in this one."""
        self._taken_now.clear()

    def abort(self) -> None:
        """Every request is dropped (KVCacheCoordinator.abort): no snapshot boundary is pending any more, and the
        snapshots planned but not copied yet (their copies are dropped with the coordinator's pending ones) give
        their slots back: indexed, they would be restored from a slot never filled."""
        self.snapshot_ends.clear()
        for h in self._taken_now:
            self._free_snapshots.append(self.snapshots.pop(h))
        self._taken_now.clear()

    def usable(self, hashes: list[bytes], k: int) -> bool:
        """A prefix of k pages has its state kept (and copied in already)."""
        return hashes[k - 1] in self.snapshots and hashes[k - 1] not in self._taken_now

    def admission_error(self, num_samples: int) -> str | None:
        if num_samples > self.num_slots:
            return (
                f"{num_samples} samples need {num_samples} state slots at once (one each); this engine has "
                f"{self.num_slots} (engine.max_num_seqs, or fewer where the KV budget holds fewer)"
            )
        return None

    def admission_waits(self, hashes: list[bytes], matched: int) -> bool:
        """A longer prefix of these pages than `matched` is being snapshotted this step (admission waits for
        it rather than compute it twice)."""
        return bool(self._taken_now) and any(h in self._taken_now for h in hashes[matched:])

    def can_admit(self, seq) -> bool:
        return self.seats(seq) <= self.num_free

    def admit(self, seq, hashes: list[bytes], k: int) -> UnitCopy | None:
        """seq's slots (its own, and one per sample it will fork); behind k cached pages, the copy of the
        snapshot at their end into its slot."""
        self.allocate(seq)
        if k == 0 or not self.num_snapshots:
            return None
        self.snapshots.move_to_end(hashes[k - 1])
        self.snapshots_restored += 1
        return UnitCopy(self.snapshots[hashes[k - 1]], self.sequences[seq.seq_id].slot)

    def keep_prefix(self, seq, hashes: list[bytes], matched: int, page_hashes, waiting) -> None:
        """The prefix of seq worth keeping a state of: the most pages its prompt shares with one of the next
        LOOKAHEAD `waiting` prompts (`page_hashes(o)` of each), beyond the `matched` it starts with, unless a
        snapshot of it is kept already. Its prefill stops there once (`limit`)."""
        self.snapshot_ends.pop(seq.seq_id, None)
        if not self.num_snapshots or not hashes:
            return
        best = 0
        for other in islice(waiting, self.LOOKAHEAD):
            theirs, n = page_hashes(other), 0
            while n < min(len(hashes), len(theirs)) and hashes[n] == theirs[n]:
                n += 1
            best = max(best, n)
        if best > matched and hashes[best - 1] not in self.snapshots:
            self.snapshot_ends[seq.seq_id] = best

    def limit(self, seq, start: int, n: int, page_size: int) -> int:
        """Tokens to compute from `start`: at most up to the boundary of the prefix seq keeps a snapshot of."""
        end = self.snapshot_ends.get(seq.seq_id, 0) * page_size
        return end - start if start < end < start + n else n

    def planned(self, seq, end: int, page_size: int, page_hashes) -> UnitCopy | None:
        """Planned up to `end`: at seq's snapshot boundary, the copy of its slot into a snapshot slot (made
        before the next step, after this step's forward has computed the state there)."""
        blocks = self.snapshot_ends.get(seq.seq_id, 0)
        if not blocks or end != blocks * page_size:
            return None
        del self.snapshot_ends[seq.seq_id]
        h = page_hashes(seq)[blocks - 1]
        if h in self.snapshots:
            return None
        if not self._free_snapshots:
            old = next((k for k in self.snapshots if k not in self._taken_now), None)
            if old is None:
                return None
            self._free_snapshots.append(self.snapshots.pop(old))
        slot = self.snapshots[h] = self._free_snapshots.pop()
        self._taken_now.add(h)
        self.snapshots_taken += 1
        return UnitCopy(self.sequences[seq.seq_id].slot, slot)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def num_free_cpu(self) -> int:
        return len(self._free_cpu)

    def seats(self, seq) -> int:
        """Slots `seq` takes when it (re)enters the running queue: its own and one per sample still to fork."""
        return 1 + seq.num_siblings_to_fork

    def unit_of(self, seq) -> int:
        """The accelerator slot seq holds (-1: none)."""
        entry = self.sequences.get(seq.seq_id)
        return entry.slot if entry is not None else -1

    def held_by(self, seq) -> list[int]:
        """The accelerator slots seq holds: its own and those reserved for its forks."""
        entry = self.sequences.get(seq.seq_id)
        return [] if entry is None or entry.slot < 0 else [entry.slot, *entry.reserved]

    def allocate(self, seq) -> None:
        entry = self.sequences.setdefault(seq.seq_id, SequenceSlots())
        assert entry.slot < 0, "a sequence holds one state slot"
        entry.slot = self._free.pop()
        entry.reserved = [self._free.pop() for _ in range(seq.num_siblings_to_fork)]

    def free(self, seq) -> None:
        """seq gives back its accelerator slots (finished or preempted); what it holds on the CPU stays."""
        entry = self.sequences.get(seq.seq_id)
        if entry is None:
            return
        for slot in (entry.slot, *entry.reserved):
            if slot >= 0:
                self._free.append(slot)
        entry.slot, entry.reserved = -1, []
        if entry.cpu_slot < 0:
            del self.sequences[seq.seq_id]

    def fork(self, parent, child) -> UnitCopy:
        """The child takes a slot its parent reserved; returns the copy of the parent's state into it."""
        mine = self.sequences[parent.seq_id]
        assert child.seq_id not in self.sequences, "a child is forked once"
        self.sequences[child.seq_id] = SequenceSlots(slot=mine.reserved.pop())
        return UnitCopy(mine.slot, self.sequences[child.seq_id].slot)

    def can_swap_out(self, seq) -> bool:
        return self.num_free_cpu > 0

    def can_swap_in(self, seq) -> bool:
        return self.seats(seq) <= self.num_free

    def swap_out(self, seq) -> UnitCopy:
        """seq's state to a CPU slot; returns the copy (accelerator slot -> CPU slot) to make before the freed
        slot is reused."""
        entry = self.sequences[seq.seq_id]
        entry.cpu_slot = self._free_cpu.popleft()
        copy = UnitCopy(entry.slot, entry.cpu_slot)
        self.free(seq)
        return copy

    def swap_in(self, seq) -> UnitCopy:
        self.allocate(seq)
        entry = self.sequences[seq.seq_id]
        copy = UnitCopy(entry.cpu_slot, entry.slot)
        self.free_cpu(seq)
        return copy

    def free_cpu(self, seq) -> None:
        entry = self.sequences.get(seq.seq_id)
        if entry is None or entry.cpu_slot < 0:
            return
        self._free_cpu.append(entry.cpu_slot)
        entry.cpu_slot = -1
        if entry.slot < 0:
            del self.sequences[seq.seq_id]

    def usage(self, running, recount: bool = False) -> Usage:
        """The slots there are, and those the running sequences hold (their own and those reserved for forks):
        as counted here, or (`recount`) sequence by sequence."""
        used = len({s for seq in running for s in self.held_by(seq)}) if recount else self.num_used
        return Usage(self.num_slots, used)

    def check(self, running, swapped) -> None:
        """Every slot is free or held by exactly one sequence (AssertionError otherwise)."""
        assert all(self.unit_of(seq) >= 0 for seq in running), "a running sequence without a state slot"
        assert {i for i, e in self.sequences.items() if e.slot >= 0} == {seq.seq_id for seq in running}, (
            "state slots held by a sequence that does not run"
        )
        held = [s for e in self.sequences.values() if e.slot >= 0 for s in (e.slot, *e.reserved)]
        assert len(held) + len(self._free) == self.num_slots, "state slots lost or held twice"
        assert not set(held) & set(self._free), "a held state slot is on the free list"
        assert {i for i, e in self.sequences.items() if e.cpu_slot >= 0} == {seq.seq_id for seq in swapped}, (
            "a swapped sequence without a CPU state slot, or one held by a sequence not swapped out"
        )
        cpu = [e.cpu_slot for e in self.sequences.values() if e.cpu_slot >= 0]
        assert len(cpu) + len(self._free_cpu) == self.num_cpu_slots, "CPU state slots lost or held twice"
        assert not set(cpu) & set(self._free_cpu), "a held CPU state slot is on the free list"
        kept = list(self.snapshots.values())
        assert len(set(kept)) == len(kept), "two prefixes share a snapshot slot"
        assert len(kept) + len(self._free_snapshots) == self.num_snapshots, "snapshot slots lost"
        assert not set(kept) & (set(held) | set(self._free)), "a snapshot slot is also a sequence's"
