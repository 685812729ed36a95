"""The scheduler's decode fast path (scheduler.py's running loop, `BlockManager.append_pages`) against its general
path, in pure integers (no model): the same workload planned twice, once as the engine plans it and once with
every decode taken through `_chunk`, `num_pages_to_grow` and `grow` (a text-only encoder budget beside the
scheduler turns the fast path off and cuts nothing), must give the same plans step for step (what each
sequence computes, its new block-table entries, preemptions, swaps), the same block tables and free counts,
tables as long as a recount of each sequence's tokens says, every page held counted once in the free count, the
runner's copy of the tables built from the plans alone equal to the block manager's, and `check_integrity()`
every step. Steps where every running sequence decodes are planned over the scheduler's columns
(steady_decodes.py; the general path's plans are the loop's), and the columns are checked every step. Page size 16; sequences cross several page boundaries while others are preempted (swapped or
dropped for recompute) and come back, beside a parallel sample's shared pages and a shared prefix (which turn
the fast path off while they are held twice), in one KV cache group and in two; a sliding-window group keeps
every decode on the general path."""

from __future__ import annotations

import numpy as np
import pytest
from test_block_manager import RunnerTables

from batchrun.engine import scheduler as scheduler_module
from batchrun.engine.attention import FULL, MaskKind
from batchrun.engine.block_manager import BlockManager
from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.kv_coordinator import KVCacheCoordinator
from batchrun.engine.scheduler import Scheduler
from batchrun.engine.sequence import NULL_PAGE, Sequence
from batchrun.engine.steady_decodes import SteadyDecodes

P = 16


@pytest.fixture(autouse=True)
def steady_from_one_sequence(monkeypatch):
    """The steady columns made for any number of running sequences (the engine waits for 16): these workloads
    run a few at a time."""
    monkeypatch.setattr(scheduler_module, "MIN_SEQS", 1)


GROUPS = {
    "full": None,
    "full+full": [FULL.first_key, FULL.first_key],  # two full groups (layers of two K/V shapes)
    "full+window": [FULL.first_key, MaskKind(window=20).first_key],
}


class TextOnlyEncoder:
    """An image-feature budget no text-only sequence touches (multimodal.EncoderCache's scheduler side): with
    one, the scheduler plans every decode by its general path."""

    def new_step(self) -> None:
        pass

    def fit(self, seq, start: int, n: int) -> int:
        return n

    def take(self, seq, start: int, n: int) -> None:
        pass


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
    return [*seqs, forked]


class Run:
    """One scheduler over its own block manager, stepped with a fake model (token 7 sampled)."""

    def __init__(self, groups, preemption: str, general: bool):
        # 21 pages: tight enough to preempt, and odd, so that two groups meet a page boundary with one page
        # free (which the fast path leaves to the general path, which preempts)
        self.bm = BlockManager(21, P, 40, first_keys=GROUPS[groups])
        config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, preemption=preemption)
        encoder = TextOnlyEncoder() if general else None
        self.scheduler = Scheduler(config, KVCacheCoordinator(self.bm), encoder=encoder)
        for s in workload():
            self.scheduler.add(s)
        self.appended, self.preempted, self.swapped_in, self.steady_steps = 0, 0, 0, 0
        append = self.bm.append_pages

        def counted(entry, num_blocks):
            self.appended += 1
            return append(entry, num_blocks)

        self.bm.append_pages = counted
        self.runner = RunnerTables()

    def step(self) -> tuple:
        """One step: what it planned, as plain values."""
        plan, bm = self.scheduler.schedule(), self.bm
        self.steady_steps += plan.decodes is not None
        self.preempted += len(plan.preempted)
        self.swapped_in += len(plan.swap_in)
        planned = [(s.seq.seq_id, s.start, s.num_new_tokens, s.new_block_ids) for s in plan.scheduled]
        for s in plan.scheduled:
            end = s.start + s.num_new_tokens
            # a recount: every group's table holds the pages of the tokens up to this step's last, no more
            assert all(len(t) == -(-end // P) for t in bm.block_tables(s.seq)), (s, end)
            self.runner.follow(s)
            s.seq.num_computed_tokens = end
        for s in plan.scheduled:
            seq = s.seq
            if not s.samples:
                continue
            for k in range(seq.num_siblings_to_fork):
                child = Sequence(
                    100 + seq.seq_id * 10 + k, seq.prompt_token_ids, seq.params, sample_index=k + 1
                )
                self.scheduler.fork(seq, child)
                child.append_token(7)
            seq.num_siblings_to_fork = 0
            seq.append_token(7)
        for seq in list(self.scheduler.running):
            if len(seq.output_token_ids) >= seq.params.max_new_tokens and seq.num_uncomputed_tokens <= 1:
                self.scheduler.finish(seq)
        live = self.scheduler.live_sequences()
        bm.check_integrity(live)
        if self.scheduler.steady is not None:
            self.scheduler.steady.check(self.scheduler.running, bm, self.scheduler.kv.prefix_cache)
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
def test_the_decode_fast_path_plans_what_the_general_path_plans(groups, preemption, monkeypatch):
    refused = []  # steps the steady columns could not plan (too few free pages: the loop preempts)
    plan = SteadyDecodes.plan

    def counted(self, *args):
        decodes = plan(self, *args)
        refused.append(decodes is None)
        return decodes

    monkeypatch.setattr(SteadyDecodes, "plan", counted)
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
    assert general.appended == 0 and general.steady_steps == 0
    if groups == "full+window":  # pages go back behind the window: never the fast path
        assert fast.appended == 0 and fast.steady_steps == 0
    else:  # many decodes crossed into a new page by the fast path, steps planned over its columns among them
        assert fast.appended >= 10 and fast.steady_steps >= 10 and any(refused)


def test_the_steady_columns_are_checked_against_the_sequences():
    """`SteadyDecodes.check` fails on a sequence whose computed count, length limit or pages moved under it."""
    run = Run("full", "swap", general=False)
    while run.scheduler.steady is None:
        run.step()
    steady, running, cache = run.scheduler.steady, run.scheduler.running, run.bm.prefix_cache
    steady.check(running, run.bm, cache)
    seq = next(iter(running))
    for field, change in [("num_computed_tokens", 1), ("reserved_tokens", -1)]:
        setattr(seq, field, getattr(seq, field) + change)
        with pytest.raises(AssertionError):
            steady.check(running, run.bm, cache)
        setattr(seq, field, getattr(seq, field) - change)
    steady.rooms[0] += P
    with pytest.raises(AssertionError):
        steady.check(running, run.bm, cache)
    steady.rooms[0] -= P
    steady.check(running, run.bm, cache)


def test_the_steady_columns_hold_the_generated_tokens_until_a_sequence_is_read_or_written():
    """While the steady columns hold each step's sampled tokens (`SteadyDecodes.generated`, the output processor's
    plain pass), a sequence's own fields fall behind, and its properties do not: reading one sequence writes its
    tokens in, a write to any writes every sequence's in and holds no more, and so does dropping the columns."""
    bm = BlockManager(64, P, 40)
    scheduler = Scheduler(EngineConfig(max_num_seqs=8, max_num_batched_tokens=64), KVCacheCoordinator(bm))
    seqs = [Sequence(i, [100 + i] * (5 + i), SamplingParams(max_new_tokens=40)) for i in range(3)]
    for seq in seqs:
        seq.reserved_tokens = seq.num_prompt_tokens + 40
        scheduler.add(seq)

    def step(tokens: list[int]) -> None:
        plan = scheduler.schedule()
        if plan.decodes is not None:  # the output processor's plain pass, in short
            plan.decodes.owner.generated(np.array(tokens))
            return
        for s in plan.scheduled:
            s.seq.num_computed_tokens = s.start + s.num_new_tokens
        for s, token in zip(plan.scheduled, tokens):
            s.seq.append_token(token)

    step([1, 2, 3])  # the prompts
    step([4, 5, 6])  # decodes, planned by the loop: the columns are made
    steady = scheduler.steady
    assert steady is not None
    step([7, 8, 9])
    step([10, 11, 12])  # two steps held
    assert all(s._pending is steady for s in seqs)
    assert [s._output_token_ids for s in seqs] == [[1, 4], [2, 5], [3, 6]]
    assert seqs[0].output_token_ids == [1, 4, 7, 10] and seqs[0]._output_token_ids == [1, 4, 7, 10]
    assert seqs[0].num_computed_tokens == seqs[0].num_tokens - 1 == 5 + 3
    assert seqs[1]._output_token_ids == [2, 5]  # not read yet
    steady.check(scheduler.running, bm, bm.prefix_cache)
    step([13, 14, 15])
    seqs[2].num_computed_tokens = seqs[2].num_computed_tokens  # a writer: every sequence's written in
    assert all(s._pending is None for s in seqs)
    assert [s._output_token_ids for s in seqs] == [[1, 4, 7, 10, 13], [2, 5, 8, 11, 14], [3, 6, 9, 12, 15]]
    assert [s._num_computed_tokens for s in seqs] == [s.num_prompt_tokens + 4 for s in seqs]
    step([16, 17, 18])  # held again
    assert seqs[1]._output_token_ids[-1] == 14
    scheduler.finish(seqs[0])  # the running set changes: the columns go, written in first
    assert scheduler.steady is None and all(s._pending is None for s in seqs)
    assert [s._output_token_ids[-1] for s in seqs] == [16, 17, 18]


@pytest.mark.parametrize("steady", [False, True])
def test_a_cached_page_taken_in_the_step_another_fills_its_page_is_indexed_as_the_loop_indexes_it(
    steady, monkeypatch
):
    """A step where sequence i fills a page whose hash a free cached page X holds, and sequence j after it crosses
    into a new page with X the only free page: the loop registers i's page first (its hash is taken: not indexed),
    then j takes X (its hash goes with it); the steady columns must do the same, in the same order."""
    if not steady:
        monkeypatch.setattr(scheduler_module, "MIN_SEQS", 10**9)
    bm = BlockManager(3, P, 40)
    scheduler = Scheduler(EngineConfig(max_num_seqs=8, max_num_batched_tokens=64), KVCacheCoordinator(bm))

    def step(tokens: dict[int, int]) -> object:
        plan = scheduler.schedule()
        if plan.decodes is not None:
            plan.decodes.owner.generated(np.array([tokens[i] for i in plan.decodes.req_ids]))
            return plan
        for s in plan.scheduled:
            s.seq.num_computed_tokens = s.start + s.num_new_tokens
            if s.samples:
                s.seq.append_token(tokens[s.seq.seq_id])
        return plan

    first_page = list(range(1, P + 1))
    a = Sequence(0, [*first_page, 99], SamplingParams(max_new_tokens=1))  # its first page cached, then freed
    a.reserved_tokens = a.num_prompt_tokens + 1
    scheduler.add(a)
    step({0: 5})
    scheduler.finish(a)
    (x,) = bm.pool._hash_to_page.values()  # A's first page: free, cached
    i = Sequence(1, first_page[:14], SamplingParams(max_new_tokens=8))  # generates 15, 16: the same page
    j = Sequence(2, [50 + k for k in range(P - 1)], SamplingParams(max_new_tokens=8))  # crosses at 16
    for seq in (i, j):
        seq.reserved_tokens = seq.num_prompt_tokens + 8
        scheduler.add(seq)
    step({1: 15, 2: 7})  # the prompts
    step({1: 16, 2: 7})  # first decodes (the loop's)
    assert bm.num_free_pages == 1 and bm.pool.page_hash.get(x) is not None  # X alone is free, cached
    plan = step({1: 17, 2: 7})  # i fills [1..16]; j crosses into X
    assert (plan.decodes is not None) == steady
    assert bm.block_tables(j)[0][-1] == x
    assert all(page != bm.block_tables(i)[0][0] for page in bm.pool._hash_to_page.values())  # not indexed
    assert i.output_token_ids == [15, 16, 17] and j.output_token_ids == [7, 7, 7]
