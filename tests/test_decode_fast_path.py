"""The scheduler's decodes planned over its columns (running_rows.py, `Scheduler._decodes`,
`BlockManager.append_pages`) against its general path, in pure integers (no model): the same workload planned
twice, once as the engine plans it and once with every row taken through `_chunk`, `num_pages_to_grow` and
`grow` (`RunningRows.decodes` finding none), must give the same plans step for step (what each sequence computes,
its new block-table entries, preemptions, swaps), the same block tables and free counts, tables as long as a
recount of each sequence's tokens says, every page held counted once in the free count, the runner's copy of
the tables built from the plans alone equal to the block manager's, and the columns checked every step. Page
size 16; sequences cross several page boundaries while others are preempted (swapped or dropped for recompute)
and come back, beside a parallel sample's shared pages and a shared prefix (which send every row to the general
path while they are held twice), in one KV cache group, in two, and in two of which one gives pages back behind
a sliding window."""

from __future__ import annotations

import numpy as np
import pytest
from test_block_manager import RunnerTables

from batchrun.engine.attention import FULL, MaskKind
from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.core.block_manager import BlockManager
from batchrun.engine.core.kv_coordinator import KVCacheCoordinator
from batchrun.engine.core.running_rows import RunningRows
from batchrun.engine.core.scheduler import Scheduler
from batchrun.engine.core.scheduler_output import SampledOutput
from batchrun.engine.core.sequence import NULL_PAGE, Sequence

P = 16


@pytest.fixture(autouse=True)
def general_path(monkeypatch):
    """A block manager flagged `general` has its scheduler find no decodes over the columns (every row planned
    by the general path); the others count the rows they found (`found`)."""
    decodes = RunningRows.decodes

    def counted(self, bm, snapshot_ends):
        found = decodes(self, bm, snapshot_ends)
        if getattr(bm, "general", False):
            return np.zeros_like(found)
        bm.found = getattr(bm, "found", 0) + int(found.sum())
        return found

    monkeypatch.setattr(RunningRows, "decodes", counted)


GROUPS = {
    "full": None,
    "full+full": [FULL.first_key, FULL.first_key],  # two full groups (layers of two K/V shapes)
    "full+window": [FULL.first_key, MaskKind(window=20).first_key],
}


def workload() -> list[Sequence]:
    """Prompts ending before, on and past page boundaries, decoded across several more; two sharing a two-page
    prefix and one with two parallel samples, short-lived (the fast path waits while they share pages)."""
    shapes = [(5, 60), (16, 40), (17, 50), (31, 70), (40, 35), (3, 90), (47, 20)]
    seqs = []
    for i, (prompt, new) in enumerate(shapes):
        seqs.append(Sequence(i, [100 + i] * prompt, SamplingParams(max_new_tokens=new)))
    common = list(range(2 * P))
    seqs.append(Sequence(7, common + [1, 2, 3], SamplingParams(max_new_tokens=6)))
    seqs.append(Sequence(8, common + [4, 5], SamplingParams(max_new_tokens=4)))
    forked = Sequence(9, [9] * 20, SamplingParams(max_new_tokens=5, n=2))
    forked.num_siblings_to_fork = 1
    for seq in [*seqs, forked]:
        seq.reserved_tokens = seq.num_prompt_tokens + seq.params.max_new_tokens
    return [*seqs, forked]


def sampled_sevens(plan, tokens=None) -> SampledOutput:
    """What a fake model gives back: each sequence that samples samples `tokens[its id]` (7 where None), a prompt
    of n samples makes the other n - 1 (ids 100 + 10 * its id + k)."""
    out = SampledOutput([], [])
    for s in plan.scheduled:
        seq = s.seq
        if not s.samples:
            continue
        for k in range(seq.num_siblings_to_fork):
            child = Sequence(100 + seq.seq_id * 10 + k, seq.prompt_token_ids, seq.params, sample_index=k + 1)
            child.output_token_ids, child.reserved_tokens = list(seq.output_token_ids), seq.reserved_tokens
            out.forks.append((seq, child))
            out.seqs.append(child)
        seq.num_siblings_to_fork = 0
        out.seqs.append(seq)
    out.tokens = [7 if tokens is None else tokens[seq.seq_id] for seq in out.seqs]
    return out


class Run:
    """One scheduler over its own block manager, stepped with a fake model (token 7 sampled)."""

    def __init__(self, groups, preemption: str, general: bool):
        # 21 pages: tight enough to preempt, and odd, so that two groups meet a page boundary with one page
        # free (which the fast path leaves to the general path, which preempts)
        self.bm = BlockManager(21, P, 40, first_keys=GROUPS[groups])
        self.bm.general = general
        config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, preemption=preemption)
        self.scheduler = Scheduler(config, KVCacheCoordinator(self.bm))
        for s in workload():
            self.scheduler.add(s)
        self.appended, self.preempted, self.swapped_in = 0, 0, 0
        append = self.bm.append_pages

        def counted(entry, num_blocks):
            self.appended += 1
            return append(entry, num_blocks)

        self.bm.append_pages = counted
        self.runner = RunnerTables()

    def step(self) -> tuple:
        """One step: what it planned, as plain values."""
        plan, bm = self.scheduler.schedule(), self.bm
        self.preempted += len(plan.preempted)
        self.swapped_in += len(plan.swap_in)
        planned = [(s.seq.seq_id, s.start, s.num_new_tokens, s.new_block_ids) for s in plan.scheduled]
        for s in plan.scheduled:
            end = s.start + s.num_new_tokens
            # a recount: every group's table holds the pages of the tokens up to this step's last, no more
            assert all(len(t) == -(-end // P) for t in bm.block_tables(s.seq)), (s, end)
            self.runner.follow(s)
        self.scheduler.update_from_output(plan, sampled_sevens(plan))
        live = self.scheduler.live_sequences()
        bm.check_integrity(live)
        rows = self.scheduler.rows
        if rows is not None:
            rows.check(self.scheduler.running, bm, self.scheduler.kv.units_of)
        self.runner.check(self.scheduler.running, bm)
        held = {p for e in bm.sequences.values() for t in e.tables for p in t if p != NULL_PAGE}
        assert bm.num_free_pages == bm.num_pages - len(held)
        return (
            planned,
            [s.seq_id for s in plan.preempted],
            [s.seq_id for s in plan.recomputed],
            plan.swap_out,
            plan.swap_in,
            plan.copy_on_write,
            plan.num_generating,
            plan.num_batched_tokens,
            plan.tables_changed,
        )

    def state(self) -> tuple:
        """Every sequence's pages and prefix-cache record, the free counts and the prefix cache's index."""
        bm = self.bm
        records = {
            i: (e.tables, e.cpu_tables, e.num_registered, len(e.hash_chain)) for i, e in bm.sequences.items()
        }
        index = dict(bm.pool._hash_to_page)  # the prefix cache's pages by hash: registered in the same order
        return records, bm.num_free_pages, bm.cpu_pool.num_free, bm.num_table_entries, index


@pytest.mark.parametrize("groups", sorted(GROUPS))
@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_the_decodes_over_columns_plan_what_the_general_path_plans(groups, preemption):
    fast, general = Run(groups, preemption, general=False), Run(groups, preemption, general=True)
    for step in range(2000):
        if not fast.scheduler.has_unfinished():
            break
        assert fast.step() == general.step(), f"step {step}"
        assert fast.state() == general.state(), f"step {step}"
    else:
        raise AssertionError("did not finish")
    assert not general.scheduler.has_unfinished()
    assert fast.bm.num_free_pages == fast.bm.num_pages and not fast.bm.sequences
    assert fast.preempted > 0 and (preemption == "recompute" or fast.swapped_in > 0)  # the pool was tight
    # many decodes planned over the columns, crossing into new pages among them (behind a window too)
    assert general.appended == 0 and fast.appended >= 10 and fast.bm.found >= 200


def test_the_columns_are_checked_against_the_sequences():
    """`RunningRows.check` fails on a row whose computed count, length or pages moved under it."""
    run = Run("full", "swap", general=False)
    while run.scheduler.rows is None or not run.bm.found:
        run.step()
    rows, running, units_of = run.scheduler.rows, run.scheduler.running, run.scheduler.kv.units_of
    rows.check(running, run.bm, units_of)
    for column in (rows.computed, rows.num_tokens, rows.rooms):
        column[0] += 1
        with pytest.raises(AssertionError):
            rows.check(running, run.bm, units_of)
        column[0] -= 1
    rows.check(running, run.bm, units_of)


@pytest.mark.parametrize("general", [False, True])
def test_a_cached_page_taken_in_the_step_another_fills_its_page_is_indexed_as_the_loop_indexes_it(general):
    """A step where sequence i fills a page whose hash a free cached page X holds, and sequence j after it crosses
    into a new page with X the only free page: the general path registers i's page first (its hash is taken: not
    indexed), then j takes X (its hash goes with it); the columns' plan must do the same, in the same order."""
    bm = BlockManager(3, P, 40)
    bm.general = general
    scheduler = Scheduler(EngineConfig(max_num_seqs=8, max_num_batched_tokens=64), KVCacheCoordinator(bm))

    def step(tokens: dict[int, int]) -> object:
        plan = scheduler.schedule()
        scheduler.update_from_output(plan, sampled_sevens(plan, tokens))
        return plan

    first_page = list(range(1, P + 1))
    a = Sequence(0, [*first_page, 99], SamplingParams(max_new_tokens=1))  # its first page cached, then freed
    a.reserved_tokens = a.num_prompt_tokens + 1
    scheduler.add(a)
    step({0: 5})
    assert not scheduler.has_unfinished()
    (x,) = bm.pool._hash_to_page.values()  # A's first page: free, cached
    i = Sequence(1, first_page[:14], SamplingParams(max_new_tokens=8))  # generates 15, 16: the same page
    j = Sequence(2, [50 + k for k in range(P - 1)], SamplingParams(max_new_tokens=8))  # crosses at 16
    for seq in (i, j):
        seq.reserved_tokens = seq.num_prompt_tokens + 8
        scheduler.add(seq)
    step({1: 15, 2: 7})  # the prompts
    step({1: 16, 2: 7})  # first decodes
    assert bm.num_free_pages == 1 and bm.pool.page_hash.get(x) is not None  # X alone is free, cached
    found = getattr(bm, "found", 0)
    step({1: 17, 2: 7})  # i fills [1..16]; j crosses into X
    assert getattr(bm, "found", 0) - found == (0 if general else 2)
    assert bm.block_tables(j)[0][-1] == x
    assert all(page != bm.block_tables(i)[0][0] for page in bm.pool._hash_to_page.values())  # not indexed
    assert i.output_token_ids == [15, 16, 17] and j.output_token_ids == [7, 7, 7]
