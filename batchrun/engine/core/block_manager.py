"""The block tables of sequences: which pages each one holds, taken from and given back to the page pools
(page_pool.py), with prefix sharing, copy-on-write forks and swapping to CPU pages.

KV cache groups: a model whose layers attend differently (full attention, a sliding window of W tokens, chunks)
has one group per kind of layer, and a sequence one block table per group (`SequencePages.tables`); the pages
of every group come from the one pool (a page holds the same number of layers in every group: engine/kv_cache).
A group whose queries never look further back than a window frees the pages that fall wholly behind it (`trim`):
their entries become `NULL`. A model of one kind has one group, and everything below is the plain paged cache.

The block manager owns each sequence's page state (`SequencePages`, keyed by `seq_id`): a `Sequence` keeps its
tokens and status, and asks here for its tables (`block_tables(seq)`).

The model runner keeps its own copy of each running sequence's tables (input_batch.py) and learns only what
changed: each record notes, per group, the first entry the runner has not seen as it is (`unsent`: a new table
from 0, an appended page from the old end, a copy on write at the page replaced), and the scheduler's plan takes
those entries once (`take_new_block_ids`). An entry given back behind a window is not sent: the runner's copy
keeps the old number, which no backend reads (every query's window starts after it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from batchrun.engine.core.cache_spec import PageCopy
from batchrun.engine.core.page_pool import CpuPagePool, PageLayout, PagePool, held_pages
from batchrun.engine.core.prefix_cache import PrefixCache, PrefixMatch
from batchrun.engine.core.sequence import NULL_PAGE, Sequence


@dataclass(eq=False, slots=True)
class SequencePages:
    """What the block manager keeps for one sequence: a block table per KV cache group (empty while it waits
    or is swapped out), its CPU pages per group while swapped out, and the chained hash of each full page of its
    tokens (prefix_cache.py; the tokens are only appended, so the chain only grows, through a preemption too)
    with how many of those pages the prefix cache has indexed."""

    tables: list[list[int]]
    cpu_tables: list[list[int]]
    hash_chain: list[bytes] = field(default_factory=list)
    num_registered: int = 0
    # per group, the first entry of its table the model runner has not seen as it is; None: it has them all
    unsent: list[int] | None = None

    def num_held(self) -> int:
        """Pages its block tables hold (entries given back behind a window not counted)."""
        return sum(len(t) - t.count(NULL_PAGE) for t in self.tables)


class BlockManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_cpu_pages: int = 0,
        prefix_sharing: bool = True,
        first_keys: list | None = None,
    ):
        self.pool = PagePool(num_pages)
        self.cpu_pool = CpuPagePool(num_cpu_pages)
        self.layout = PageLayout(page_size, first_keys)
        self.num_pages, self.num_cpu_pages, self.page_size = num_pages, num_cpu_pages, page_size
        self.num_groups = self.layout.num_groups
        self.sequences: dict[int, SequencePages] = {}  # seq_id -> its pages, from its first lookup to its end
        self.prefix_cache = PrefixCache(self.pool, self.layout, self.pages, enabled=prefix_sharing)
        # counters for statistics
        # entries of every block table (those behind a window too), kept as the tables change: the statistics'
        self.num_table_entries = 0
        self.num_cow_copies = 0
        self.num_window_freed = 0  # pages released because they fell behind their group's window

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.pool.num_free

    def _no_tables(self) -> list[list[int]]:
        return [[] for _ in range(self.num_groups)]

    # ---- per sequence ---------------------------------------------------------------------------------------
    def pages(self, seq: Sequence) -> SequencePages:
        """seq's page state (made empty on its first lookup: a waiting sequence's hash chain is kept here too)."""
        entry = self.sequences.get(seq.seq_id)
        if entry is None:
            entry = self.sequences[seq.seq_id] = SequencePages(self._no_tables(), self._no_tables())
        return entry

    def block_tables(self, seq: Sequence) -> list[list[int]]:
        """seq's block table per KV cache group (the lists themselves: read them, the block manager writes)."""
        return self.pages(seq).tables

    def take_new_block_ids(self, seq: Sequence) -> list[tuple[int, list[int]]] | None:
        """Per group, (the first entry the model runner has not seen, the entries from there), handed on once
        (the runner's tables have them after this step); None: its tables have not changed since."""
        entry = self.sequences[seq.seq_id]
        unsent = entry.unsent
        if unsent is None:
            return None
        entry.unsent = None
        return [(c, t[c:]) for c, t in zip(unsent, entry.tables)]

    def forget(self, seq: Sequence) -> None:
        """Drop what is kept of a sequence that holds no page (a waiting one, given up)."""
        entry = self.sequences.pop(seq.seq_id, None)
        assert entry is None or not (any(entry.tables) or any(entry.cpu_tables)), "forget frees no page"

    # ---- admission ------------------------------------------------------------------------------------------
    def num_new_pages_for_admission(
        self, seq: Sequence, match: PrefixMatch | None = None, max_chunk: int | None = None
    ) -> int:
        """Free pages that admitting `seq` (all its uncomputed prompt, in steps of at most `max_chunk` tokens)
        takes, prefix-cache hits deducted: a full group holds the whole prompt, a windowed one what a step reads.
        A hit on a free cached page still takes that page off the free list. `match`: match_prefix(seq), when
        the caller has it already."""
        match = match if match is not None else self.prefix_cache.match(seq)
        start, end = match.num_blocks * self.page_size, seq.num_tokens
        need = 0
        for g, table in enumerate(match.tables):
            held = [p for p in table if p != NULL_PAGE]
            most = self.layout.max_pages_held(g, start, end, max_chunk or end)
            need += max(0, most - len(held)) + sum(1 for p in held if self.pool.ref_count[p] == 0)
        return need

    def allocate_sequence(self, seq: Sequence, max_new_tokens: int, match: PrefixMatch | None = None) -> int:
        """Admit a waiting sequence: reuse its cached prefix pages, then give it pages for its next uncomputed
        tokens, at most `max_new_tokens` of them (a chunk, or the whole prompt). Returns how many."""
        entry = self.pages(seq)
        assert not any(entry.tables), "a sequence is admitted once"
        match = match if match is not None else self.prefix_cache.match(seq)
        self.pool.acquire_tables(match.tables)
        entry.tables = [list(t) for t in match.tables]
        self.num_table_entries += sum(map(len, entry.tables))
        entry.unsent = [0] * self.num_groups
        entry.num_registered = match.num_blocks  # its cached prefix is indexed already
        seq.num_computed_tokens = match.num_blocks * self.page_size
        self.prefix_cache.query_tokens += seq.num_tokens
        self.prefix_cache.hit_tokens += seq.num_computed_tokens
        n = min(max_new_tokens, seq.num_uncomputed_tokens)
        cow = self.grow(seq, n)
        assert not cow, "a new sequence never writes into a shared page"
        return n

    # ---- running ----------------------------------------------------------------------------------------------
    def trim(self, seq: Sequence) -> int:
        """Release the pages each windowed group of `seq` will not read again (wholly before the first key its
        next query sees); returns how many."""
        freed = 0
        if not self.layout.windowed:
            return 0  # full attention only: the common case, every step of every sequence
        for g, table in enumerate(self.sequences[seq.seq_id].tables):
            first = min(self.layout.first_block(g, seq.num_computed_tokens), len(table))
            # the entries given back earlier are a run at the head: walk back from `first` to it, not from 0
            # (every step, for every sequence and group)
            start = first
            while start > 0 and table[start - 1] != NULL_PAGE:
                start -= 1
            for b in range(start, first):
                self.pool.release(table[b])
                table[b] = NULL_PAGE
            freed += first - start
        self.num_window_freed += freed
        return freed

    def _is_shared(self, table: list[int], block: int) -> bool:
        """Block `block` of `table` (the one the next token is written into) is a page another table holds too
        (a fork): copy on write."""
        return block < len(table) and table[block] != NULL_PAGE and self.pool.ref_count[table[block]] > 1

    def num_pages_to_grow(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free pages that computing seq's next `num_new_tokens` tokens takes: new pages past the end of each
        block table, plus a private copy when the first page written into is shared (copy-on-write)."""
        computed, P = seq.num_computed_tokens, self.page_size
        end_pages = -(-(computed + num_new_tokens) // P)
        first, windowed, shared = computed // P, self.layout.windowed, self.pool.num_shared
        needed = 0
        for g, table in enumerate(self.sequences[seq.seq_id].tables):  # every step, every sequence: kept lean
            n = len(table)
            start = max(n, self.layout.first_block(g, computed)) if windowed else n
            if end_pages > start:
                needed += end_pages - start
            if shared:  # no page held twice: nothing to copy on write
                needed += self._is_shared(table, first)
        return needed

    def grow(self, seq: Sequence, num_new_tokens: int) -> list[PageCopy]:
        """Make the slots of seq's next `num_new_tokens` tokens writable; returns the copy-on-write copies."""
        cows, entry = [], self.sequences[seq.seq_id]
        first = seq.num_computed_tokens // self.page_size
        end_pages = self.layout.pages_needed(seq.num_computed_tokens + num_new_tokens)
        for g, table in enumerate(entry.tables):
            changed = len(table)  # the first entry this changes
            if self._is_shared(table, first):
                page, new_page = table[first], self.pool.allocate()
                self.pool.release(page)
                table[first] = new_page
                changed = first
                self.num_cow_copies += 1
                cows.append(PageCopy(page, new_page))
            skip = self.layout.first_block(g, seq.num_computed_tokens)  # blocks its queries never read
            self.num_table_entries += max(0, end_pages - len(table))
            while len(table) < end_pages:
                table.append(NULL_PAGE if len(table) < skip else self.pool.allocate())
            if changed < len(table):  # the runner's copy lacks entries from `changed` on
                if entry.unsent is None:
                    entry.unsent = [len(t) for t in entry.tables]
                entry.unsent[g] = min(entry.unsent[g], changed)
        return cows

    def append_pages(self, entry: SequencePages, num_blocks: int) -> list[tuple[int, list[int]]]:
        """A new page at the end of each of `entry`'s tables shorter than `num_blocks` (a decode crossing into a
        new page, where no page is shared and no group has a window: what `grow` does there), handed on at
        once: the runner's news, in take_new_block_ids' form. The caller checked that the pages are free."""
        news, allocate = [], self.pool.allocate
        for table in entry.tables:
            n = len(table)
            if n < num_blocks:
                page = allocate()
                news.append((n, [page]))
                table.append(page)
                self.num_table_entries += 1
            else:
                news.append((n, []))
        return news

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every page of the parent (parallel sampling)."""
        mine = self.sequences[parent.seq_id]
        self.pool.acquire_tables(mine.tables)
        self.num_table_entries += sum(map(len, mine.tables))
        assert child.seq_id not in self.sequences, "a child is forked once"
        self.sequences[child.seq_id] = SequencePages(
            [list(t) for t in mine.tables],
            self._no_tables(),
            list(mine.hash_chain),
            mine.num_registered,
            [0] * self.num_groups,  # a new table to the runner
        )
        child.num_computed_tokens = parent.num_computed_tokens

    def free_sequence(self, seq: Sequence) -> None:
        """Give back seq's pages (finished, or preempted to be computed again). Its hash chain stays: its tokens
        are the same."""
        entry = self.sequences[seq.seq_id]
        self.pool.release_tables(entry.tables)
        self.num_table_entries -= sum(map(len, entry.tables))
        entry.tables = self._no_tables()
        entry.num_registered = 0

    def finish(self, seq: Sequence) -> None:
        """seq is done: its pages go back and nothing of it is kept."""
        self.free_sequence(seq)
        del self.sequences[seq.seq_id]

    # ---- swapping -------------------------------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return self.sequences[seq.seq_id].num_held() <= self.cpu_pool.num_free

    def swap_out(self, seq: Sequence) -> list[PageCopy]:
        """Move seq's pages to CPU pages; returns (accelerator page, CPU page) copies to make *before* any
        accelerator page freed here is reused. A shared page gets a private CPU copy; the other holders keep it."""
        copies, entry = [], self.sequences[seq.seq_id]
        entry.cpu_tables = []
        for table in entry.tables:
            cpu_table = [NULL_PAGE if p == NULL_PAGE else self.cpu_pool.allocate() for p in table]
            copies += [PageCopy(p, c) for p, c in zip(table, cpu_table) if p != NULL_PAGE]
            entry.cpu_tables.append(cpu_table)
        registered = entry.num_registered
        self.free_sequence(seq)
        entry.num_registered = registered  # indexed again when its pages come back (swap_in)
        return copies

    def num_pages_to_swap_in(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free pages that bringing seq back and computing its next tokens takes."""
        end_pages = self.layout.pages_needed(seq.num_computed_tokens + num_new_tokens)
        return sum(
            sum(1 for p in t if p != NULL_PAGE) + max(0, end_pages - len(t))
            for t in self.sequences[seq.seq_id].cpu_tables
        )

    def swap_in(self, seq: Sequence) -> list[PageCopy]:
        """Move seq's CPU pages back to fresh accelerator pages; returns (CPU page, accelerator page) copies."""
        copies, entry = [], self.sequences[seq.seq_id]
        entry.tables = []
        for cpu_table in entry.cpu_tables:
            table = [NULL_PAGE if c == NULL_PAGE else self.pool.allocate() for c in cpu_table]
            for c, p in zip(cpu_table, table):
                if c != NULL_PAGE:
                    copies.append(PageCopy(c, p))
                    self.cpu_pool.release(c)
            entry.tables.append(table)
        self.num_table_entries += sum(map(len, entry.tables))
        entry.cpu_tables = self._no_tables()
        entry.unsent = [0] * self.num_groups  # new pages: a new table to the runner
        # the swapped-in pages are private copies; re-register them only where the hash is not taken
        self.prefix_cache.register(seq)
        return copies

    def free_cpu_pages(self, seq: Sequence) -> None:
        """Drop a swapped sequence's CPU pages and all that is kept of it (an aborted request)."""
        for cpu_page in held_pages(self.sequences.pop(seq.seq_id).cpu_tables):
            self.cpu_pool.release(cpu_page)

    # ---- checks ----------------------------------------------------------------------------------------------
    def check_integrity(self, sequences: Iterable[Sequence] = ()) -> None:
        """free + used == total in both pools, every reference count equals the number of block tables that
        hold the page, and the sequences holding pages are exactly `sequences` (pass every live one).
        Raises AssertionError."""
        expected = [0] * self.num_pages
        expected_cpu = [0] * self.num_cpu_pages
        groups_of_page: dict[int, set[int]] = {}
        holding = {i for i, e in self.sequences.items() if any(e.tables) or any(e.cpu_tables)}
        live = {seq.seq_id for seq in sequences}
        assert holding == live, f"pages held by no live sequence {holding - live}, none by {live - holding}"
        for entry in self.sequences.values():
            assert len(entry.tables) == self.num_groups or not any(entry.tables), "one table a group"
            for g, table in enumerate(entry.tables):
                for p in table:
                    if p != NULL_PAGE:
                        expected[p] += 1
                        groups_of_page.setdefault(p, set()).add(g)
            for p in held_pages(entry.cpu_tables):
                expected_cpu[p] += 1
        self.pool.check(expected)
        self.cpu_pool.check(expected_cpu)
        entries = sum(len(t) for e in self.sequences.values() for t in e.tables)
        assert self.num_table_entries == entries, (self.num_table_entries, entries)
        assert all(len(g) == 1 for g in groups_of_page.values()), "a page is held by two groups"
