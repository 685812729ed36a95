"""Block manager and scheduler: pure integer bookkeeping, checked under random operations (no model)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchrun.engine.attention import FULL, MaskKind
from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.core.block_manager import BlockManager
from batchrun.engine.core.kv_coordinator import KVCacheCoordinator
from batchrun.engine.core.scheduler import Scheduler
from batchrun.engine.core.scheduler_output import SampledOutput, ScheduledSequence
from batchrun.engine.core.sequence import NULL_PAGE, Sequence

# KV cache groups, as the engine makes them from the layers' mask kinds: one full group (no window), a full
# group beside a sliding one of 5 tokens, a sliding group alone, a full group beside a chunked one of 8
GROUPS = {
    "full": None,
    "full+window": [FULL.first_key, MaskKind(window=5).first_key],
    "window": [MaskKind(window=6).first_key],
    "full+chunk": [FULL.first_key, MaskKind(chunk=8).first_key],
}


def seq(i, tokens, max_new=8, n=1):
    s = Sequence(i, list(tokens), SamplingParams(max_new_tokens=max_new, n=n))
    s.num_siblings_to_fork = n - 1
    s.reserved_tokens = (
        len(s.prompt_token_ids) + max_new
    )  # where it finishes by length (as the engine sets it)
    return s


def test_allocate_free_roundtrip_and_lru_order():
    bm = BlockManager(8, 4)
    a = seq(0, range(10))
    assert bm.allocate_sequence(a, 100) == 10
    assert len(bm.block_tables(a)[0]) == 3 and bm.num_free_pages == 5
    a.num_computed_tokens = 10
    bm.prefix_cache.register_full_pages(a, a.num_computed_tokens)
    assert bm.pages(a).num_registered == 2 and len(bm.pages(a).hash_chain) == 2  # two full pages of 4
    bm.check_integrity([a])
    bm.free_sequence(a)
    bm.check_integrity([])
    assert bm.num_free_pages == 8
    # a new sequence with the same first 8 tokens revives the two cached pages
    b = seq(1, list(range(8)) + [99, 98])
    assert bm.num_new_pages_for_admission(b) == 3
    bm.allocate_sequence(b, 100)
    assert b.num_computed_tokens == 8 and bm.prefix_cache.hit_tokens == 8
    # uncached pages are handed out before cached ones
    c = seq(2, range(100, 120))
    bm.allocate_sequence(c, 100)
    bm.check_integrity([b, c])


def test_hash_collision_is_checked_against_tokens():
    bm = BlockManager(4, 2)
    a = seq(0, [1, 2, 3])
    bm.allocate_sequence(a, 10)
    a.num_computed_tokens = 3
    bm.prefix_cache.register_full_pages(a, a.num_computed_tokens)
    page = bm.block_tables(a)[0][0]
    bm.pool.page_tokens[page] = (7, 7)  # as if another prefix had hashed the same
    assert bm.prefix_cache.match(seq(1, [1, 2, 3])).num_blocks == 0


def test_last_prompt_token_is_always_computed():
    bm = BlockManager(8, 4)
    a = seq(0, range(8))
    bm.allocate_sequence(a, 100)
    a.num_computed_tokens = 8
    bm.prefix_cache.register_full_pages(a, a.num_computed_tokens)
    b = seq(1, range(8))
    bm.allocate_sequence(b, 100)
    assert b.num_computed_tokens == 4 and b.num_uncomputed_tokens == 4


def test_fork_shares_pages_and_copy_on_write():
    bm = BlockManager(8, 4)
    parent = seq(0, range(6))
    bm.allocate_sequence(parent, 100)
    parent.num_computed_tokens = 6
    child = seq(1, range(6))
    bm.fork(parent, child)
    assert bm.block_tables(child)[0] == bm.block_tables(parent)[0]
    assert all(bm.pool.ref_count[p] == 2 for p in bm.block_tables(parent)[0])
    parent.output_token_ids.append(50)
    child.output_token_ids.append(51)
    assert bm.num_pages_to_grow(child, 1) == 1  # the shared half-full page must be copied
    (cow,) = bm.grow(child, 1)
    assert cow.src == bm.block_tables(parent)[0][1] and cow.dst == bm.block_tables(child)[0][1]
    assert bm.num_pages_to_grow(parent, 1) == 0  # the parent now holds that page alone
    bm.check_integrity([parent, child])


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "grow", "fork", "free", "swap_out", "swap_in", "trim"]), st.integers(0, 10**6)
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=ops,
    num_pages=st.integers(1, 24),
    page_size=st.sampled_from([1, 2, 4, 8]),
    cpu_pages=st.integers(0, 24),
    sharing=st.booleans(),
    groups=st.sampled_from(sorted(GROUPS)),
)
def test_random_operations_keep_reference_counts_exact(ops, num_pages, page_size, cpu_pages, sharing, groups):
    bm = BlockManager(num_pages, page_size, cpu_pages, prefix_sharing=sharing, first_keys=GROUPS[groups])
    running, swapped = [], []
    next_id = 0
    for op, r in ops:
        if op == "add":
            s = seq(next_id, [r % 3] * (1 + r % 20))  # repetitive tokens: prefix hits happen
            next_id += 1
            if bm.num_new_pages_for_admission(s) <= bm.num_free_pages:
                bm.allocate_sequence(s, 10**6)
                s.num_computed_tokens = s.num_tokens
                bm.prefix_cache.register_full_pages(s, s.num_computed_tokens)
                running.append(s)
        elif op == "grow" and running:
            s = running[r % len(running)]
            s.output_token_ids.append(r % 3)
            if bm.num_pages_to_grow(s, 1) <= bm.num_free_pages:
                bm.grow(s, 1)
                s.num_computed_tokens += 1
                bm.prefix_cache.register_full_pages(s, s.num_computed_tokens)
            else:
                s.output_token_ids.pop()
        elif op == "fork" and running:
            parent = running[r % len(running)]
            child = seq(next_id, parent.prompt_token_ids)
            child.output_token_ids = list(parent.output_token_ids)
            next_id += 1
            bm.fork(parent, child)
            running.append(child)
        elif op == "free" and running:
            bm.free_sequence(running.pop(r % len(running)))
        elif op == "swap_out" and running:
            s = running[r % len(running)]
            if bm.can_swap_out(s):
                bm.swap_out(s)
                running.remove(s)
                swapped.append(s)
        elif op == "swap_in" and swapped:
            s = swapped[0]
            if bm.num_pages_to_swap_in(s, 0) <= bm.num_free_pages:
                bm.swap_in(s)
                swapped.pop(0)
                running.append(s)
        elif op == "trim" and running:
            bm.trim(running[r % len(running)])
        bm.check_integrity(running + swapped)
    for s in running:
        bm.free_sequence(s)
    for s in swapped:
        bm.swap_in(s) if bm.num_pages_to_swap_in(s, 0) <= bm.num_free_pages else None
        bm.free_sequence(s)
    assert bm.num_free_pages == num_pages


class RunnerTables:
    """The block tables as a model runner would hold them, as plain lists, built from nothing but each plan's
    `new_block_ids`: after every step they must equal the block manager's (pages behind a window aside)."""

    def __init__(self):
        self.tables: dict[int, list[list[int]]] = {}

    def follow(self, s) -> None:
        if s.new_block_ids is None:
            assert s.seq.seq_id in self.tables, "unchanged tables the runner never had"
            return
        mine = self.tables.setdefault(s.seq.seq_id, [[] for _ in s.new_block_ids])
        for g, (column, pages) in enumerate(s.new_block_ids):
            assert column <= len(mine[g]), "a gap in the runner's table"
            mine[g] = mine[g][:column] + list(pages)

    def check(self, running, bm) -> None:
        for seq in running:
            record = bm.sequences[seq.seq_id]
            if record.unsent is not None:  # forked since the last plan: its table comes whole with the next
                continue
            for want, have in zip(record.tables, self.tables[seq.seq_id]):
                assert len(want) == len(have) and all(w in (h, NULL_PAGE) for w, h in zip(want, have))


def drive(scheduler: Scheduler, max_steps: int = 20000):
    """Run the scheduler with a fake model (every sampled token is 7); returns finished sequences."""
    bm = scheduler.kv.bm
    finished, runner_tables = [], RunnerTables()
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return finished
        plan = scheduler.schedule()
        assert not plan.is_empty or plan.preempted, "no progress: deadlock"
        assert bm.num_used_pages <= bm.num_pages
        # the counts the scheduler keeps as it plans (for the runner and the statistics), recounted from the plan
        scheduled = plan.scheduled
        assert plan.num_batched_tokens == sum(s.num_new_tokens for s in scheduled)
        assert plan.num_generating == sum(s.samples and s.start >= s.seq.num_prompt_tokens for s in scheduled)
        assert plan.scores_prompts == any(s.prompt_logprob_positions for s in scheduled)
        assert plan.tables_changed == any(s.new_block_ids is not None for s in scheduled)
        for s in plan.scheduled:
            # every group's pages hold the tokens the step writes, and what the plan says of a sequence is what
            # ScheduledSequence works out from its tokens (the scheduler plans most decodes by a shorter path)
            end = s.start + s.num_new_tokens
            assert all(len(t) * bm.page_size >= end for t in bm.block_tables(s.seq)), (s, end)
            assert s == ScheduledSequence(s.seq, s.num_new_tokens, s.start, s.new_block_ids, s.units)
            runner_tables.follow(s)
        # what the engine's output processor gives back: token 7 for each sequence that samples, the other
        # samples of a prompt just computed made from it
        sampled = SampledOutput([], [])
        for s in plan.scheduled:
            if not s.samples:
                continue
            seq_ = s.seq
            for k in range(seq_.num_siblings_to_fork):
                child = Sequence(
                    10**6 + seq_.seq_id * 100 + k, seq_.prompt_token_ids, seq_.params, sample_index=k + 1
                )
                child.output_token_ids, child.reserved_tokens = (
                    list(seq_.output_token_ids),
                    seq_.reserved_tokens,
                )
                sampled.forks.append((seq_, child))
                sampled.seqs.append(child)
            seq_.num_siblings_to_fork = 0
            sampled.seqs.append(seq_)
        sampled.tokens = [7] * len(sampled.seqs)
        finished += scheduler.update_from_output(plan, sampled)
        bm.check_integrity(scheduler.live_sequences())
        runner_tables.check(scheduler.running, bm)
    raise AssertionError("did not finish: livelock")


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(
        st.tuples(st.integers(1, 60), st.integers(1, 30), st.integers(1, 3)), min_size=1, max_size=25
    ),
    page_size=st.sampled_from([1, 4, 16]),
    extra_pages=st.integers(0, 40),
    cpu_pages=st.integers(0, 60),
    preemption=st.sampled_from(["swap", "recompute"]),
    budget=st.integers(1, 128),
    max_num_seqs=st.integers(1, 16),
    sharing=st.booleans(),
    groups=st.sampled_from(sorted(GROUPS)),
)
def test_scheduler_never_deadlocks_or_leaks(
    lengths, page_size, extra_pages, cpu_pages, preemption, budget, max_num_seqs, sharing, groups
):
    # the pool is always big enough for the largest single sequence in every group (admission rejects the
    # others up front)
    num_groups = len(GROUPS[groups] or [None])
    biggest = max(-(-(p + m) // page_size) * n for p, m, n in lengths) * num_groups
    bm = BlockManager(
        biggest + extra_pages, page_size, cpu_pages, prefix_sharing=sharing, first_keys=GROUPS[groups]
    )
    sched = Scheduler(
        EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, preemption=preemption),
        KVCacheCoordinator(bm),
    )
    for i, (p, m, n) in enumerate(lengths):
        s = seq(i, [i % 2] * p, max_new=m, n=n)
        if n == 1 and i % 3 == 0:  # it scores its prompt (marked as the engine marks such a sequence)
            s.prompt_logprobs = [None]
        sched.add(s)
    done = drive(sched)
    assert len(done) == sum(n for _, _, n in lengths)
    assert not bm.sequences  # nothing kept of a finished sequence
    bm.check_integrity([])
    assert bm.num_free_pages == bm.num_pages and bm.cpu_pool.num_free == cpu_pages


def test_scheduler_preempts_under_pressure_and_swaps_back():
    bm = BlockManager(12, 4, num_cpu_pages=40)
    sched = Scheduler(
        EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, preemption="swap"), KVCacheCoordinator(bm)
    )
    for i in range(6):
        sched.add(seq(i, [i] * 6, max_new=20))
    preempted, swapped_in = 0, 0
    orig = sched.schedule

    def counting():
        nonlocal preempted, swapped_in
        plan = orig()
        preempted += len(plan.preempted)
        swapped_in += len(plan.swap_in)
        return plan

    sched.schedule = counting
    done = drive(sched)
    assert len(done) == 6 and preempted > 0 and swapped_in > 0
    assert all(s.num_preemptions >= 0 for s in done) and sum(s.num_preemptions for s in done) == preempted


def test_abort_all_frees_running_swapped_and_waiting():
    bm = BlockManager(12, 4, num_cpu_pages=40)
    sched = Scheduler(
        EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, preemption="swap"), KVCacheCoordinator(bm)
    )
    for i in range(8):
        sched.add(seq(i, [i] * 6, max_new=20))
    swapped_seen = False
    for _ in range(40):  # until some are running and some swapped out
        plan = sched.schedule()
        sampling = [s.seq for s in plan.scheduled if s.samples]
        sched.update_from_output(plan, SampledOutput(sampling, [7] * len(sampling)))
        swapped_seen = bool(sched.swapped and sched.running)
        if swapped_seen:
            break
    assert swapped_seen, "the workload should leave sequences swapped out next to running ones"
    sched.abort_all()
    assert not sched.has_unfinished()
    bm.check_integrity([])
    assert bm.num_free_pages == 12 and bm.cpu_pool.num_free == 40


def test_a_sliding_group_gives_back_the_pages_behind_its_window():
    """Window 5, pages of 4: once the next query is at position p, the pages wholly before p - 4 go back; the
    full group keeps everything."""
    bm = BlockManager(32, 4, first_keys=GROUPS["full+window"])
    s = seq(0, range(20))
    bm.allocate_sequence(s, 100)
    s.num_computed_tokens = 20  # the next query is at 20: it sees keys 16..20, pages 4 (16-19) and on
    assert bm.num_used_pages == 10
    assert bm.trim(s) == 4
    full, window = bm.block_tables(s)
    assert NULL_PAGE not in full and window[:4] == [NULL_PAGE] * 4 and NULL_PAGE not in window[4:]
    assert bm.num_used_pages == 6 and bm.num_window_freed == 4
    assert bm.trim(s) == 0
    # a decode appends a page to each group as before
    s.output_token_ids.append(9)
    assert bm.num_pages_to_grow(s, 1) == 2
    bm.grow(s, 1)
    bm.check_integrity([s])
    bm.free_sequence(s)
    assert bm.num_free_pages == 32


def test_prefix_sharing_with_a_window_matches_only_what_the_window_reads():
    bm = BlockManager(64, 4, first_keys=GROUPS["full+window"])
    a = seq(0, list(range(30)))
    bm.allocate_sequence(a, 100)
    a.num_computed_tokens = 30
    bm.prefix_cache.register_full_pages(a, 30)
    bm.trim(a)  # the window group keeps the pages from 26 - 2 on: blocks 6, 7
    window_a = list(bm.block_tables(a)[1])
    b = seq(1, list(range(29)) + [99, 98])  # shares 29 tokens: 7 full pages
    match = bm.prefix_cache.match(b)
    assert match.num_blocks == 7  # positions 0..27; the next query (28) reads keys 24.. (block 6) only
    full, window = match.tables
    assert full == bm.block_tables(a)[0][:7] and window == [NULL_PAGE] * 6 + window_a[6:7]
    # a prefix whose window reads a page `a` gave back: it is free but cached, so it is revived
    c = seq(2, list(range(12)) + [77] * 10)
    match_c = bm.prefix_cache.match(c)
    assert match_c.num_blocks == 3 and match_c.tables[1][:2] == [NULL_PAGE] * 2
    revived = match_c.tables[1][2]
    assert bm.pool.ref_count[revived] == 0 and bm.pool.page_hash.get(revived) is not None
    bm.allocate_sequence(b, 100, match)
    bm.allocate_sequence(c, 100, match_c)
    assert bm.pool.ref_count[revived] == 1
    bm.check_integrity([a, b, c])


def test_abort_gives_back_the_snapshots_planned_but_not_copied():
    """A hybrid's prefix snapshot is planned in one step and copied before the next: abort_all in between drops
    that copy, so the snapshot must not stay indexed (a later prompt with the same prefix would start from a slot
    never filled), and no sequence's snapshot boundary is kept."""
    from batchrun.engine.core.state_slots import StateSlots

    bm, states = BlockManager(64, 4, 16), StateSlots(4, 2, 2)
    scheduler = Scheduler(
        EngineConfig(max_num_seqs=4, max_num_batched_tokens=64), KVCacheCoordinator(bm, states)
    )
    common = list(range(12))
    scheduler.add(seq(0, common + [50, 51, 52]))
    scheduler.add(seq(1, common + [60, 61, 62]))
    plan = scheduler.schedule()  # 0 stops at the 12 tokens it shares with 1, whose state is kept
    assert plan.scheduled[0].num_new_tokens == 12 and states.snapshot_ends == {}
    for s in plan.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
    scheduler.abort_all()
    assert not states.snapshots and not states.snapshot_ends and not bm.sequences and not states.sequences
    states.check([], [])
    scheduler.add(seq(2, common + [70, 71, 72]))
    assert scheduler.schedule().unit_copies[0].device == []  # computes its prefix: no snapshot to restore


def test_block_table_rows_follow_every_kind_of_change():
    """The runner's persistent rows (block_table_buffer.py), written from nothing but the plan's changes, against
    plain lists: a whole table (admission, swap-in, fork), a page appended, the last page replaced (copy on
    write), both in one plan, a shorter table rewritten (a recompute readmitted), rows in and out of order, the
    buffer widened and given more rows, and tables left unchanged."""
    from batchrun.engine.worker.block_table_buffer import BlockTableBuffer

    buffer = BlockTableBuffer(num_groups=2, capacity=2)
    tables = {}

    def step(changes: dict, rows: list[int]):
        """`changes`: row -> per group (first entry changed, entries from there); the others are unchanged."""
        for row, new in changes.items():
            tables[row] = [t[:c] + pages for t, (c, pages) in zip(tables.get(row, [[], []]), new)]
        buffer.write(list(changes), list(changes.values()))
        got = buffer.step_tables(rows)
        for g in range(2):
            assert got[g].shape == (len(rows), max(len(tables[r][g]) for r in rows))
            for i, r in enumerate(rows):
                assert got[g][i, : len(tables[r][g])].tolist() == tables[r][g], (rows, g, r)
        for r in rows:
            buffer.check(r, tables[r], None)

    step({0: [(0, [3, 4]), (0, [5])], 1: [(0, [6]), (0, [])]}, [0, 1])
    for k in range(40):  # pages appended past the buffer's width (16): it doubles
        change = {0: [(len(tables[0][0]), [100 + k]), (1, [])]}
        if k % 3 == 0:
            change[1] = [(1, []), (len(tables[1][1]), [200 + k])]
        step(change, [1, 0])
    n = len(tables[0][0])
    step({0: [(n - 1, [999, 1000]), (1, [])]}, [0, 1])  # copy on write of the last page, then a page appended
    step({}, [0])  # unchanged: nothing written
    step({1: [(0, [7]), (0, [8, 9])]}, [0, 1])  # a whole new table, shorter than the row held (a recompute)
    buffer.grow_rows(4)  # the input batch's rows doubled: the rows kept
    step({3: [(0, [11]), (0, [12])]}, [3, 0, 1])
    with pytest.raises(AssertionError):  # a stale row is caught
        buffer.check(3, [[11, 13], [12]], None)


def test_block_table_steps_reuse_the_last_tables_until_a_write():
    """A step of the same rows as the last, with nothing written, grown or widened since, takes the last step's
    tables as they are (BlockTableBuffer._last); anything else makes them again. Each step's tables against a
    recount of what was written (plain lists), over rows in order (views of the unpinned buffers) and out of
    order (gathered)."""
    from batchrun.engine.worker.block_table_buffer import BlockTableBuffer

    buffer = BlockTableBuffer(num_groups=2, capacity=4)
    tables = {}

    def write(changes: dict):
        for row, new in changes.items():
            tables[row] = [t[:c] + pages for t, (c, pages) in zip(tables.get(row, [[], []]), new)]
        buffer.write(list(changes), list(changes.values()))

    def step(rows: list[int]) -> list:
        got = buffer.step_tables(rows)
        for g in range(2):
            width = max(1, *(len(tables[r][g]) for r in rows))
            assert got[g].shape == (len(rows), width), (rows, g)
            for i, r in enumerate(rows):
                assert got[g][i, : len(tables[r][g])].tolist() == tables[r][g], (rows, g, r)
        return got

    write({0: [(0, [1, 2]), (0, [3])], 1: [(0, [4]), (0, [5, 6])], 2: [(0, [7, 8, 9]), (0, [])]})
    for rows in ([0, 1, 2], [2, 0, 1]):  # in order: views (unpinned); out of order: gathered
        first = step(rows)
        again = step(list(rows))  # the same rows, nothing written: the very same tables
        assert all(a is b for a, b in zip(first, again))
        write({rows[1]: [(len(tables[rows[1]][0]), [10 + rows[1]]), (0, tables[rows[1]][1])]})  # a new page
        after = step(rows)
        assert all(a is not b for a, b in zip(first, after))
        assert step(rows)[0] is after[0]
    views = step([0, 1])
    assert views[0].untyped_storage().data_ptr() == buffer.tables[0].untyped_storage().data_ptr()
    gathered = step([1, 0])
    assert gathered[0].untyped_storage().data_ptr() != buffer.tables[0].untyped_storage().data_ptr()
    # grown rows between two steps of the same rows: the buffers are new, so are the tables
    step([0, 2])
    buffer.grow_rows(8)
    write({5: [(0, [50]), (0, [51])]})
    step([0, 2])
    grown = step([0, 2])
    buffer.grow_rows(16)
    assert step([0, 2])[0] is not grown[0]
    # a write widening the buffer (past its 16 entries) on a row not in the step: the step's tables again
    before = step([2, 5])
    write({0: [(len(tables[0][0]), list(range(100, 120))), (1, [])]})
    widened = step([2, 5])
    assert widened[0] is not before[0] and buffer.tables[0].shape[1] >= 22
    step([0, 5, 2])  # different rows
    step([5])
    step([0, 1, 2, 5])
