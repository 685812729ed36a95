"""A KV kind beside pages is one module (cache_kind.py): a kind declared here alone, with its own manager, tensors,
bytes per unit and usage columns, registered in the kinds' list, is sized from the budget, admitted, forked,
swapped, preempted and checked, counted in the memory snapshot and the statistics' rows, with no edit elsewhere;
and its tensors' content follows each sequence through every copy the plan carries."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from helpers import chat_ids, make_engine, run_engine

from batchrun import stats
from batchrun.engine import SamplingParams
from batchrun.engine import engine as engine_module
from batchrun.engine.architecture import inspect_model
from batchrun.engine.cache_kind import (
    CacheKind,
    KindCopies,
    KindCopy,
    KindManager,
    KindTensors,
    Usage,
    UsageColumns,
)

BYTES_PER_UNIT = 3000  # what one unit takes of the KV budget and of the swap space


@dataclass(frozen=True)
class LedgerPool:
    num_units: int
    num_cpu_units: int
    device_bytes: int
    cpu_bytes: int


@dataclass(eq=False)
class Held:
    unit: int = -1
    reserved: list[int] = field(default_factory=list)  # for the samples it will fork
    cpu_unit: int = -1


class LedgerUnits(KindManager):
    """A unit per running sequence and one reserved per sample it will fork, a CPU unit per swapped one."""

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
        self._take(seq)  # nothing kept per prefix: a prefix's unit starts afresh (the test never shares one)

    def fork(self, parent, child):
        self.held[child.seq_id] = Held(unit=self.held[parent.seq_id].reserved.pop())
        return KindCopy(self.held[parent.seq_id].unit, self.held[child.seq_id].unit)

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
        copy = KindCopy(held.unit, held.cpu_unit)
        self.free(seq)
        return copy

    def can_swap_in(self, seq):
        return self.can_admit(seq)

    def swap_in(self, seq):
        held = self._take(seq)
        copy = KindCopy(held.cpu_unit, held.unit)
        self.free_cpu(seq)
        return copy

    def usage(self, running, recount=False):
        return Usage(self.num_units, self.num_units - len(self.free_units))

    def check(self, running, swapped):
        units = [u for h in self.held.values() if h.unit >= 0 for u in (h.unit, *h.reserved)]
        assert sorted(units + self.free_units) == list(range(self.num_units)), (
            "ledger units lost or held twice"
        )
        assert {i for i, h in self.held.items() if h.unit >= 0} == {s.seq_id for s in running}
        assert {i for i, h in self.held.items() if h.cpu_unit >= 0} == {s.seq_id for s in swapped}


class Ledger(KindTensors):
    """One integer a unit: the tokens its sequence has computed, written by each step's view (as a layer's state
    is), so a unit copied for a fork, a swap out or a swap in must hold exactly what its sequence computed."""

    def __init__(self, num_units: int, num_cpu_units: int):
        self.units = torch.full((num_units,), -1, dtype=torch.long)
        self.cpu = torch.full((num_cpu_units,), -1, dtype=torch.long)
        self.copies = {"device": 0, "swap_out": 0, "swap_in": 0}
        self.mismatches: list[tuple[int, int, int]] = []

    def apply(self, copies: KindCopies) -> None:
        for c in copies.device:
            self.units[c.dst] = self.units[c.src]
        for c in copies.swap_out:
            self.cpu[c.dst] = self.units[c.src]
        for c in copies.swap_in:
            self.units[c.dst] = self.cpu[c.src]
        for where in self.copies:
            self.copies[where] += len(getattr(copies, where))

    def step_view(self, units, query_lens, starts):
        for unit, n, start in zip(units, query_lens, starts):
            if start > 0 and self.units[unit] != start:  # a sequence's unit is its computed tokens
                self.mismatches.append((unit, int(self.units[unit]), start))
            self.units[unit] = start + n
        return None


class LedgerKind(CacheKind):
    """As many units as sequences run at once, each BYTES_PER_UNIT of the KV budget, and as many CPU units as
    the swap space holds beside a page each."""

    usage_columns = UsageColumns(
        "ledger_units_total", "ledger_units_used", "bytes_per_ledger_unit", "ledger units", "the test kind"
    )
    made: list[Ledger] = []

    @property
    def bytes_per_unit(self) -> int:
        return BYTES_PER_UNIT

    @classmethod
    def of(cls, plan):
        return cls()

    def pool(self, config, budget, swap, bytes_per_page, num_groups):
        units = config.max_num_seqs
        cpu_units = min(units, swap // (BYTES_PER_UNIT + bytes_per_page))
        return LedgerPool(units, cpu_units, units * BYTES_PER_UNIT, cpu_units * BYTES_PER_UNIT)

    def manager(self, pool):
        return LedgerUnits(pool.num_units, pool.num_cpu_units)

    def tensors(self, pool, device):
        self.made.append(Ledger(pool.num_units, pool.num_cpu_units))
        return self.made[-1]


def test_a_kind_declared_in_one_module_follows_every_sequence(tok_model, monkeypatch):
    """Greedy pairs of samples in a pool too small for them: the kind takes its bytes from the budget and the
    swap space, its units are forked, swapped out and in with their sequences, its bookkeeping holds at every
    step, and its usage columns are in the memory snapshot and the statistics' rows, as counted from the
    sequences themselves."""
    tok, model = tok_model
    prompts = [
        chat_ids(tok, f"Tell me about {s}.") for s in ("rivers", "stars", "cats", "tea", "maps", "snow")
    ]
    params = SamplingParams(max_new_tokens=24, n=2, ignore_eos=True)
    monkeypatch.setattr(engine_module, "KINDS", (LedgerKind,))
    # the statistics' columns are fixed at import from the registered kinds (the file's schema, docs/statistics.md's
    # list); the test kind's are derived the same way
    monkeypatch.setattr(stats, "KIND_USAGE", (LedgerKind.usage_columns,))
    monkeypatch.setattr(stats, "COLUMNS", stats.step_columns(stats.KIND_USAGE))
    LedgerKind.made.clear()
    page = inspect_model(model).kv_spec(16, next(model.parameters()).dtype).bytes_per_page
    units, swap_pages = 16, 64 + 16 * (BYTES_PER_UNIT + page) // page
    # 14 pages once the kind's 16 units are taken out of the budget; the swap space holds 16 units with a page
    # each, and the rest is CPU pages
    engine = make_engine(
        tok_model,
        num_pages=None,
        kv_cache_memory=str(14 * page + units * BYTES_PER_UNIT),
        max_num_seqs=units,
        num_cpu_pages=swap_pages,
    )
    assert engine.num_pages == 14
    assert engine.kv.managers[0].num_cpu_units == units
    assert engine.kv.bm.num_cpu_pages == (swap_pages * page - units * BYTES_PER_UNIT) // page
    collector = stats.StatsCollector(engine)
    rows = []

    def on_step(eng, result):
        eng.check_integrity()
        running = list(eng.running_sequences())
        held = sum(1 + s.num_siblings_to_fork for s in running)  # each its unit, and one per sample to fork
        snapshot = eng.memory_snapshot()
        assert snapshot.usage == {"ledger_units_total": units, "ledger_units_used": held}
        assert snapshot == eng.memory_snapshot(recount=True)
        rows.append((collector.record(result), held))

    _, steps = run_engine(engine, prompts, params, on_step=on_step)
    ledger = LedgerKind.made[0]
    assert any(r.plan.preempted for r in steps), "the workload must preempt"
    assert all(ledger.copies.values()), f"every kind of copy must happen: {ledger.copies}"
    assert not ledger.mismatches, ledger.mismatches[:5]
    # a row is the statistics file's schema (its writer adds the run)
    schema = set(stats.COLUMNS) - {"run"}
    assert all(set(row) == schema for row, _ in rows), set(rows[0][0]) ^ schema
    assert "ledger_units_used" in stats.COLUMNS and "state_slots_used" not in stats.COLUMNS
    assert all(row["ledger_units_used"] == held and row["ledger_units_total"] == units for row, held in rows)
    assert max(held for _, held in rows) > 2
    assert engine.kind_bytes() == {"bytes_per_ledger_unit": BYTES_PER_UNIT}
