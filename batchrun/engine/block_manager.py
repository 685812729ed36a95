"""The block tables of sequences: which pages each one holds, taken from and given back to the page pools
(page_pool.py), with prefix sharing, copy-on-write forks and swapping to CPU pages.

KV cache groups: a model whose layers attend differently (full attention, a sliding window of W tokens, chunks)
has one group per kind of layer, and a sequence one block table per group (`Sequence.block_tables`); the pages
of every group come from the one pool (a page holds the same number of layers in every group: engine/kv_cache).
A group whose queries never look further back than a window frees the pages that fall wholly behind it (`trim`):
their entries become `NULL`. A model of one kind has one group, and everything below is the plain paged cache.
"""

from __future__ import annotations

from collections.abc import Iterable

from .page_pool import CpuPagePool, PageCopy, PageLayout, PagePool, held_pages
from .prefix_cache import PrefixCache, PrefixMatch
from .sequence import NULL_PAGE, Sequence


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
        self.prefix_cache = PrefixCache(self.pool, self.layout, enabled=prefix_sharing)
        # counters for statistics
        self.num_cow_copies = 0
        self.num_window_freed = 0  # pages released because they fell behind their group's window

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.pool.num_free

    @property
    def num_free_cpu_pages(self) -> int:
        return self.cpu_pool.num_free

    def _no_tables(self) -> list[list[int]]:
        return [[] for _ in range(self.num_groups)]

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
        assert not any(seq.block_tables), "a sequence is admitted once"
        match = match if match is not None else self.prefix_cache.match(seq)
        self.pool.acquire_tables(match.tables)
        seq.block_tables = [list(t) for t in match.tables]
        seq.num_registered_pages = match.num_blocks  # its cached prefix is indexed already
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
        for g, table in enumerate(seq.block_tables):
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
        first, windowed = computed // P, self.layout.windowed
        needed = 0
        for g, table in enumerate(seq.block_tables):  # every step, for every sequence: kept lean
            n = len(table)
            start = max(n, self.layout.first_block(g, computed)) if windowed else n
            if end_pages > start:
                needed += end_pages - start
            needed += self._is_shared(table, first)
        return needed

    def grow(self, seq: Sequence, num_new_tokens: int) -> list[PageCopy]:
        """Make the slots of seq's next `num_new_tokens` tokens writable; returns the copy-on-write copies."""
        cows = []
        first = seq.num_computed_tokens // self.page_size
        end_pages = self.layout.pages_needed(seq.num_computed_tokens + num_new_tokens)
        for g, table in enumerate(seq.block_tables):
            if self._is_shared(table, first):
                page, new_page = table[first], self.pool.allocate()
                self.pool.release(page)
                table[first] = new_page
                self.num_cow_copies += 1
                cows.append(PageCopy(page, new_page))
            skip = self.layout.first_block(g, seq.num_computed_tokens)  # blocks its queries never read
            while len(table) < end_pages:
                table.append(NULL_PAGE if len(table) < skip else self.pool.allocate())
        return cows

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every page of the parent (parallel sampling)."""
        self.pool.acquire_tables(parent.block_tables)
        child.block_tables = [list(t) for t in parent.block_tables]
        child.page_hash_chain = list(parent.page_hash_chain)
        child.num_registered_pages = parent.num_registered_pages
        child.num_computed_tokens = parent.num_computed_tokens

    def free_sequence(self, seq: Sequence) -> None:
        self.pool.release_tables(seq.block_tables)
        seq.block_tables = self._no_tables()
        seq.num_registered_pages = 0

    # ---- swapping -------------------------------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return seq.num_held_pages() <= self.cpu_pool.num_free

    def swap_out(self, seq: Sequence) -> list[PageCopy]:
        """Move seq's pages to CPU pages; returns (accelerator page, CPU page) copies to make *before* any
        accelerator page freed here is reused. A shared page gets a private CPU copy; the other holders keep it."""
        copies = []
        seq.cpu_block_tables = []
        for table in seq.block_tables:
            cpu_table = [NULL_PAGE if p == NULL_PAGE else self.cpu_pool.allocate() for p in table]
            copies += [PageCopy(p, c) for p, c in zip(table, cpu_table) if p != NULL_PAGE]
            seq.cpu_block_tables.append(cpu_table)
        registered = seq.num_registered_pages
        self.free_sequence(seq)
        seq.num_registered_pages = registered  # indexed again when its pages come back (swap_in)
        return copies

    def num_pages_to_swap_in(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free pages that bringing seq back and computing its next tokens takes."""
        end_pages = self.layout.pages_needed(seq.num_computed_tokens + num_new_tokens)
        return sum(
            sum(1 for p in t if p != NULL_PAGE) + max(0, end_pages - len(t)) for t in seq.cpu_block_tables
        )

    def swap_in(self, seq: Sequence) -> list[PageCopy]:
        """Move seq's CPU pages back to fresh accelerator pages; returns (CPU page, accelerator page) copies."""
        copies = []
        seq.block_tables = []
        for cpu_table in seq.cpu_block_tables:
            table = [NULL_PAGE if c == NULL_PAGE else self.pool.allocate() for c in cpu_table]
            for c, p in zip(cpu_table, table):
                if c != NULL_PAGE:
                    copies.append(PageCopy(c, p))
                    self.cpu_pool.release(c)
            seq.block_tables.append(table)
        seq.cpu_block_tables = self._no_tables()
        # the swapped-in pages are private copies; re-register them only where the hash is not taken
        self.prefix_cache.register(seq)
        return copies

    def free_cpu_pages(self, seq: Sequence) -> None:
        """Drop a swapped sequence's CPU pages (an aborted request)."""
        for cpu_page in held_pages(seq.cpu_block_tables):
            self.cpu_pool.release(cpu_page)
        seq.cpu_block_tables = self._no_tables()
        seq.num_registered_pages = 0

    # ---- checks ----------------------------------------------------------------------------------------------
    def check_integrity(self, sequences: Iterable[Sequence] = ()) -> None:
        """free + used == total in both pools, and every reference count equals the number of block tables
        (of `sequences`: pass every live sequence) that hold the page. Raises AssertionError."""
        expected = [0] * self.num_pages
        expected_cpu = [0] * self.num_cpu_pages
        groups_of_page: dict[int, set[int]] = {}
        for seq in sequences:
            assert len(seq.block_tables) == self.num_groups or not any(seq.block_tables), "one table a group"
            for g, table in enumerate(seq.block_tables):
                for p in table:
                    if p != NULL_PAGE:
                        expected[p] += 1
                        groups_of_page.setdefault(p, set()).add(g)
            for p in held_pages(seq.cpu_block_tables):
                expected_cpu[p] += 1
        self.pool.check(expected)
        self.cpu_pool.check(expected_cpu)
        assert all(len(g) == 1 for g in groups_of_page.values()), "a page is held by two groups"
