"""A KV kind beside pages is one module (cache_kind.py): a kind declared here alone, added to the registry's list,
is sized, admitted, forked, swapped, preempted and checked with no edit elsewhere, and its tensors' content
follows each sequence through every copy the plan carries."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from helpers import chat_ids, make_engine, run_engine

from batchrun.engine import SamplingParams
from batchrun.engine import engine as engine_module
from batchrun.engine.cache_kind import CacheKind, KindCopies, KindTensors
from batchrun.engine.state_slots import StateSlots


@dataclass(frozen=True)
class LedgerPool:
    num_units: int
    device_bytes: int = 0
    cpu_bytes: int = 0


class Ledger(KindTensors):
    """One integer a unit: the tokens its sequence has computed, written by each step's view (as a layer's state
    is), so a unit copied for a fork, a swap out or a swap in must hold exactly what its sequence computed."""

    def __init__(self, num_units: int):
        self.units = torch.full((num_units,), -1, dtype=torch.long)
        self.cpu = torch.full((num_units,), -1, dtype=torch.long)
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

    def step_view(self, scheduled, query_lens, starts):
        for s, n, start in zip(scheduled, query_lens, starts):
            if start > 0 and self.units[s.state_slot] != start:  # a sequence's unit is its computed tokens
                self.mismatches.append((s.req_id, int(self.units[s.state_slot]), start))
            self.units[s.state_slot] = start + n
        return None


class LedgerKind(CacheKind):
    """A unit per running sequence (one reserved per sample still to fork), a CPU unit per swapped one, no
    bytes taken from the budget: its manager is the state slots' (without prefix snapshots)."""

    made: list[Ledger] = []

    @classmethod
    def of(cls, plan):
        return cls()

    def pool(self, config, budget, swap, bytes_per_page, num_groups):
        return LedgerPool(config.max_num_seqs)

    def manager(self, pool):
        return StateSlots(pool.num_units, pool.num_units)

    def tensors(self, pool, device):
        self.made.append(Ledger(pool.num_units))
        return self.made[-1]


def test_a_kind_declared_in_one_module_follows_every_sequence(tok_model, monkeypatch):
    """Greedy pairs of samples in a pool too small for them: the kind's units are forked, swapped out and in
    with their sequences, and its bookkeeping holds at every step."""
    tok, _ = tok_model
    prompts = [
        chat_ids(tok, f"Tell me about {s}.") for s in ("rivers", "stars", "cats", "tea", "maps", "snow")
    ]
    params = SamplingParams(max_new_tokens=24, n=2, ignore_eos=True)
    monkeypatch.setattr(engine_module, "KINDS", (LedgerKind,))
    LedgerKind.made.clear()
    engine = make_engine(tok_model, num_pages=14, max_num_seqs=16, num_cpu_pages=64)
    _, steps = run_engine(engine, prompts, params, on_step=lambda e, r: e.check_integrity())
    ledger = LedgerKind.made[0]
    assert any(r.plan.preempted for r in steps), "the workload must preempt"
    assert all(ledger.copies.values()), f"every kind of copy must happen: {ledger.copies}"
    assert not ledger.mismatches, ledger.mismatches[:5]
    assert engine.memory_snapshot() == engine.memory_snapshot(recount=True)
