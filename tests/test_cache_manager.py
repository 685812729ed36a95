"""What a sequence holds beside its pages is a manager behind one protocol (kv_coordinator.CacheManager): a
manager declared here alone, given to the coordinator beside the block manager, is admitted, forked, swapped out
and in, preempted and recomputed, aborted and checked with its sequences, counted in the coordinator's usage row,
and the copies it returns are filed into its share of the plan (`unit_copies`) so that a unit's content follows
its sequence through every one of them."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest
from test_block_manager import drive, seq

from batchrun.engine.config import EngineConfig
from batchrun.engine.core.block_manager import BlockManager
from batchrun.engine.core.cache_spec import UnitCopy, Usage, UsageColumns
from batchrun.engine.core.kv_coordinator import CacheManager, KVCacheCoordinator
from batchrun.engine.core.scheduler import Scheduler


@dataclass(eq=False)
class Held:
    unit: int = -1
    reserved: list[int] = field(default_factory=list)  # for the samples it will fork
    cpu_unit: int = -1


class LedgerUnits(CacheManager):
    """A unit per running sequence and one reserved per sample it will fork, a CPU unit per swapped one."""

    usage_columns = UsageColumns(
        "ledger_units_total", "ledger_units_used", "bytes_per_ledger_unit", "ledger units", "the test"
    )
    bytes_per_unit = 3000

    def __init__(self, num_units: int, num_cpu_units: int):
        self.num_units, self.num_cpu_units = num_units, num_cpu_units
        self.free_units, self.free_cpu_units = list(range(num_units)), deque(range(num_cpu_units))
        self.held: dict[int, Held] = {}

    def _take(self, seq) -> Held:
        held = self.held.setdefault(seq.seq_id, Held())
        held.unit = self.free_units.pop()
        held.reserved = [self.free_units.pop() for _ in range(seq.num_siblings_to_fork)]
        return held

    def _drop(self, seq) -> None:
        held = self.held[seq.seq_id]
        if held.unit < 0 and held.cpu_unit < 0:
            del self.held[seq.seq_id]

    def usable(self, hashes, k):
        return False  # a unit holds what its sequence computed from its first token: no cached prefix has it

    def admission_error(self, num_samples):
        return None if num_samples <= self.num_units else "more samples than ledger units"

    def can_admit(self, seq):
        return 1 + seq.num_siblings_to_fork <= len(self.free_units)

    def admit(self, seq, hashes, matched):
        self._take(seq)

    def fork(self, parent, child):
        self.held[child.seq_id] = Held(unit=self.held[parent.seq_id].reserved.pop())
        return UnitCopy(self.held[parent.seq_id].unit, self.held[child.seq_id].unit)

    def unit_of(self, seq):
        held = self.held.get(seq.seq_id)
        return -1 if held is None else held.unit

    def free(self, seq):
        held = self.held.get(seq.seq_id)
        if held is not None and held.unit >= 0:
            self.free_units += [held.unit, *held.reserved]
            held.unit, held.reserved = -1, []
            self._drop(seq)

    def free_cpu(self, seq):
        held = self.held.get(seq.seq_id)
        if held is not None and held.cpu_unit >= 0:
            self.free_cpu_units.append(held.cpu_unit)
            held.cpu_unit = -1
            self._drop(seq)

    def can_swap_out(self, seq):
        return bool(self.free_cpu_units)

    def swap_out(self, seq):
        held = self.held[seq.seq_id]
        held.cpu_unit = self.free_cpu_units.popleft()
        copy = UnitCopy(held.unit, held.cpu_unit)
        self.free(seq)
        return copy

    def can_swap_in(self, seq):
        return self.can_admit(seq)

    def swap_in(self, seq):
        held = self._take(seq)
        copy = UnitCopy(held.cpu_unit, held.unit)
        self.free_cpu(seq)
        return copy

    def usage(self, running, recount=False):
        if recount:
            return Usage(self.num_units, sum(1 + len(self.held[s.seq_id].reserved) for s in running))
        return Usage(self.num_units, self.num_units - len(self.free_units))

    def check(self, running, swapped):
        units = [u for h in self.held.values() if h.unit >= 0 for u in (h.unit, *h.reserved)]
        assert sorted(units + self.free_units) == list(range(self.num_units)), (
            "ledger units lost or held twice"
        )
        assert {i for i, h in self.held.items() if h.unit >= 0} == {s.seq_id for s in running}
        assert {i for i, h in self.held.items() if h.cpu_unit >= 0} == {s.seq_id for s in swapped}


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_a_manager_declared_alone_follows_every_sequence(preemption):
    """Pairs of samples in a pool too small for them: the test's manager holds a unit per sequence, each unit's
    content (the tokens its sequence computed, written as a step's view writes a layer's state) is moved by the
    copies the coordinator files into the plan, in their order (within the device, out, in), and every
    scheduled sequence's unit holds exactly what its sequence computed; the bookkeeping holds at every step,
    and the usage row counts the units held as recounted from the sequences."""
    units, cpu_units = 16, 16
    ledger = LedgerUnits(units, cpu_units)
    kv = KVCacheCoordinator(BlockManager(20, 4, num_cpu_pages=200), ledger)
    scheduler = Scheduler(
        EngineConfig(max_num_seqs=units, max_num_batched_tokens=64, preemption=preemption), kv
    )
    for i in range(6):
        scheduler.add(seq(i, [i] * 10, max_new=24, n=2))
    device, cpu = [-1] * units, [-1] * cpu_units  # each unit's content: its sequence's computed tokens
    copies = {"device": 0, "swap_out": 0, "swap_in": 0}
    mismatches, preempted, held_most = [], 0, 0
    schedule = scheduler.schedule

    def step():
        nonlocal preempted, held_most
        plan = schedule()
        (mine,) = plan.unit_copies  # the one manager's share of the plan, as the engine applies it
        for c in mine.device:
            device[c.dst] = device[c.src]
        for c in mine.swap_out:
            cpu[c.dst] = device[c.src]
        for c in mine.swap_in:
            device[c.dst] = cpu[c.src]
        for where in copies:
            copies[where] += len(getattr(mine, where))
        for s in plan.scheduled:
            (unit,) = s.units
            if s.start > 0 and device[unit] != s.start:
                mismatches.append((s.seq.seq_id, device[unit], s.start))
            device[unit] = s.start + s.num_new_tokens
        running = list(scheduler.running)
        held = sum(1 + s.num_siblings_to_fork for s in running)  # each its unit, and one per sample to fork
        assert (
            kv.usage(running)
            == kv.usage(running, recount=True)
            == {
                "ledger_units_total": units,
                "ledger_units_used": held,
            }
        )
        kv.check_integrity(running, scheduler.swapped)
        preempted += len(plan.preempted)
        held_most = max(held_most, held)
        return plan

    scheduler.schedule = step
    done = drive(scheduler)
    assert len(done) == 12 and preempted, "the workload must finish every sample, and preempt"
    assert copies["device"], "forks copy units"
    if preemption == "swap":
        assert copies["swap_out"] and copies["swap_in"], copies
    assert not mismatches, mismatches[:5]
    assert held_most > 2 and kv.unit_bytes() == {"bytes_per_ledger_unit": 3000}
    kv.check_integrity([], [])
    assert not ledger.held and len(ledger.free_units) == units
