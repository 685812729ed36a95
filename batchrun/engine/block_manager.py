"""Pure integer bookkeeping of KV pages: free lists, reference counts, prefix hashes and CPU swap slots.

No tensors here. The accelerator pool has `num_pages` pages of `page_size` token slots; the CPU pool has
`num_cpu_pages`. A page's reference count is the number of block tables holding it. A freed page that carries
a prefix hash keeps its contents and can be revived by a later sequence until the allocator reuses it; free
pages without a hash are handed out before pages with one; among those with a hash, the least recently freed
first (so a popular prefix survives longest).

KV cache groups: a model whose layers attend differently (full attention, a sliding window of W tokens, chunks)
has one group per kind of layer, and a sequence one block table per group (`Sequence.block_tables`); the pages
of every group come from the one pool (a page holds the same number of layers in every group: engine/kv_cache).
A group whose queries never look further back than a window frees the pages that fall wholly behind it (`trim`):
their entries become `NULL`. A model of one kind has one group, and everything below is the plain paged cache.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import NamedTuple

from .sequence import NULL_PAGE, Sequence


class PageCopy(NamedTuple):
    src: int
    dst: int


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the pages that `a` tokens fill at `b` tokens a page."""
    return -(-a // b)


def chain_hash(prev_hash: int | None, tokens: Iterable[int]) -> int:
    """Hash of a full page, chained over every token before it (through prev_hash) and in it."""
    return hash((prev_hash, tuple(tokens)))


class PrefixMatch(NamedTuple):
    """Cached pages holding a prefix of a sequence: `num_blocks` full pages, each group's table for them
    (NULL where a windowed group no longer needs the page) and the pages' hashes."""

    num_blocks: int
    tables: list[list[int]]
    hashes: list[int]


class BlockManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_cpu_pages: int = 0,
        prefix_sharing: bool = True,
        first_keys: list | None = None,
    ):
        """`first_keys`: per KV cache group, a function from a query position to the first key position that
        query sees (MaskKind.first_key); None: one group of full attention."""
        if num_pages < 1:
            raise ValueError("the accelerator pool needs at least one page")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_cpu_pages = num_cpu_pages
        self.prefix_sharing = prefix_sharing
        self.first_keys = list(first_keys) if first_keys else [lambda pos: 0]
        self.num_groups = len(self.first_keys)
        self.windowed = any(fk(1 << 40) > 0 for fk in self.first_keys)  # some group gives pages back
        self.ref_count = [0] * num_pages
        # a stack: the page freed last is handed out first, so the pages ever touched (and the process's memory
        # on the CPU, where the pool is lazily zeroed) stay at the peak in use, not the whole pool
        self._free_uncached: list[int] = list(range(num_pages - 1, -1, -1))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # oldest-freed first
        self.page_hash: dict[int, int] = {}  # page -> hash, for full pages with known contents
        self.page_tokens: dict[int, tuple[int, ...]] = {}  # page -> its tokens, to rule out collisions
        self.hash_to_page: dict[tuple[int, int], int] = {}  # (group, hash) -> page
        self.page_group: dict[int, int] = {}  # page -> group, for pages with a hash
        self.cpu_ref_count = [0] * num_cpu_pages
        self._cpu_free: deque[int] = deque(range(num_cpu_pages))
        # counters for statistics
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_cow_copies = 0
        self.num_window_freed = 0  # pages released because they fell behind their group's window

    # ---- accelerator pages -------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    def allocate_page(self) -> int:
        if self._free_uncached:
            page = self._free_uncached.pop()
        elif self._free_cached:
            page, _ = self._free_cached.popitem(last=False)
            self._forget_hash(page)
        else:
            raise RuntimeError("no free page: the scheduler must check before allocating")
        assert self.ref_count[page] == 0
        self.ref_count[page] = 1
        return page

    def acquire_page(self, page: int) -> None:
        """Add a reference to a page in use, or revive a free cached page."""
        if self.ref_count[page] == 0:
            del self._free_cached[page]
        self.ref_count[page] += 1

    def release_page(self, page: int) -> None:
        assert self.ref_count[page] > 0, f"page {page} released more often than held"
        self.ref_count[page] -= 1
        if self.ref_count[page] == 0:
            if page in self.page_hash:
                self._free_cached[page] = None
            else:
                self._free_uncached.append(page)

    def _forget_hash(self, page: int) -> None:
        h = self.page_hash.pop(page, None)
        self.page_tokens.pop(page, None)
        group = self.page_group.pop(page, None)
        if h is not None and self.hash_to_page.get((group, h)) == page:
            del self.hash_to_page[(group, h)]

    def _register(self, group: int, h: int, page: int, tokens: tuple[int, ...]) -> None:
        if (group, h) not in self.hash_to_page and page not in self.page_hash:
            self.hash_to_page[(group, h)] = page
            self.page_hash[page] = h
            self.page_group[page] = group
            self.page_tokens[page] = tokens

    # ---- sequences ----------------------------------------------------------------------------------------
    def pages_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.page_size)

    def first_block(self, group: int, pos: int) -> int:
        """The first block of `group` that queries at positions >= pos still read."""
        return self.first_keys[group](pos) // self.page_size

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """Cached pages that hold a prefix of seq's tokens, in every group (a windowed group only the pages its
        window still reads at the prefix's end). The last token is never matched: its logits are needed, so at
        least one token of the prompt is always computed."""
        if not self.prefix_sharing or seq.prompt_logprobs is not None:
            return PrefixMatch(0, [[] for _ in range(self.num_groups)], [])  # a scoring sequence computes all
        tokens = seq.token_ids
        P = self.page_size
        hashes: list[int] = []
        prev = None
        for i in range((len(tokens) - 1) // P):
            chunk = tuple(tokens[i * P : (i + 1) * P])
            prev = chain_hash(prev, chunk)
            hashes.append(prev)
        # per group, the last block before each k that is not cached (-1: none), then the longest prefix k for
        # which every group holds the blocks it reads: those from first_block(group, k * P) on
        last_miss = []
        for g in range(self.num_groups):
            latest, misses = -1, []
            for i, h in enumerate(hashes):
                page = self.hash_to_page.get((g, h))
                if page is None or self.page_tokens.get(page) != tuple(tokens[i * P : (i + 1) * P]):
                    latest = i
                misses.append(latest)
            last_miss.append(misses)
        for k in range(len(hashes), 0, -1):
            if all(last_miss[g][k - 1] < self.first_block(g, k * P) for g in range(self.num_groups)):
                tables = [self._cached_table(g, hashes, k) for g in range(self.num_groups)]
                return PrefixMatch(k, tables, hashes[:k])
        return PrefixMatch(0, [[] for _ in range(self.num_groups)], [])

    def _cached_table(self, group: int, hashes: list[int], k: int) -> list[int]:
        """The group's table of the first k blocks from the cache (NULL before the blocks it reads)."""
        first = self.first_block(group, k * self.page_size)
        return [NULL_PAGE] * first + [self.hash_to_page[(group, hashes[i])] for i in range(first, k)]

    def max_pages_held(self, group: int, start: int, end: int, max_chunk: int) -> int:
        """The most pages `group` holds while a sequence computes its tokens [start, end) in steps of at most
        `max_chunk` tokens: all of them in a full group; in a windowed one, those a step's queries read."""
        if not self.windowed:
            return self.pages_needed(end)
        most, c = 0, start
        while c < end:
            e = min(c + max_chunk, end)
            most = max(most, self.pages_needed(e) - self.first_block(group, c))
            c = e
        return most

    def pages_to_run(self, num_prompt_tokens: int, num_tokens: int, max_chunk: int) -> int:
        """The most pages one sequence holds at once over its life: a prompt prefilled in chunks, then decoded
        to `num_tokens` (in a windowed group, the decode's span is largest at the last page boundaries)."""
        total = 0
        for g in range(self.num_groups):
            prefill = self.max_pages_held(g, 0, num_prompt_tokens, max_chunk)
            tail = max(num_prompt_tokens, num_tokens - self.page_size)
            decode = self.max_pages_held(g, tail, num_tokens, 1) if num_tokens > num_prompt_tokens else 0
            total += max(prefill, decode)
        return total

    def num_new_pages_for_admission(
        self, seq: Sequence, match: PrefixMatch | None = None, max_chunk: int | None = None
    ) -> int:
        """Free pages that admitting `seq` (all its uncomputed prompt, in steps of at most `max_chunk` tokens)
        takes, prefix-cache hits deducted: a full group holds the whole prompt, a windowed one what a step reads.
        A hit on a free cached page still takes that page off the free list. `match`: match_prefix(seq), when
        the caller has it already."""
        match = match if match is not None else self.match_prefix(seq)
        start, end = match.num_blocks * self.page_size, seq.num_tokens
        need = 0
        for g, table in enumerate(match.tables):
            held = [p for p in table if p != NULL_PAGE]
            most = self.max_pages_held(g, start, end, max_chunk or end)
            need += max(0, most - len(held)) + sum(1 for p in held if self.ref_count[p] == 0)
        return need

    def allocate_sequence(self, seq: Sequence, max_new_tokens: int, match: PrefixMatch | None = None) -> int:
        """Admit a waiting sequence: reuse its cached prefix pages, then give it pages for its next uncomputed
        tokens, at most `max_new_tokens` of them (a chunk, or the whole prompt). Returns how many."""
        assert not any(seq.block_tables), "a sequence is admitted once"
        match = match if match is not None else self.match_prefix(seq)
        for table in match.tables:
            for p in table:
                if p != NULL_PAGE:
                    self.acquire_page(p)
        seq.block_tables = [list(t) for t in match.tables]
        seq.block_hashes = list(match.hashes)
        seq.num_computed_tokens = match.num_blocks * self.page_size
        self.prefix_query_tokens += seq.num_tokens
        self.prefix_hit_tokens += seq.num_computed_tokens
        n = min(max_new_tokens, seq.num_uncomputed_tokens)
        cow = self.grow(seq, n)
        assert not cow, "a new sequence never writes into a shared page"
        return n

    def trim(self, seq: Sequence) -> int:
        """Release the pages each windowed group of `seq` will not read again (wholly before the first key its
        next query sees); returns how many."""
        freed = 0
        if not self.windowed:
            return 0  # full attention only: the common case, every step of every sequence
        for g, table in enumerate(seq.block_tables):
            first = min(self.first_block(g, seq.num_computed_tokens), len(table))
            # the entries given back earlier are a run at the head: walk back from `first` to it, not from 0
            # (every step, for every sequence and group)
            start = first
            while start > 0 and table[start - 1] != NULL_PAGE:
                start -= 1
            for b in range(start, first):
                self.release_page(table[b])
                table[b] = NULL_PAGE
            freed += first - start
        self.num_window_freed += freed
        return freed

    def num_pages_to_grow(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free pages that computing seq's next `num_new_tokens` tokens takes: new pages past the end of each
        block table, plus a private copy when the first page written into is shared (copy-on-write)."""
        first = seq.num_computed_tokens // self.page_size
        end_pages = self.pages_needed(seq.num_computed_tokens + num_new_tokens)
        needed = 0
        for g, table in enumerate(seq.block_tables):
            start = max(len(table), self.first_block(g, seq.num_computed_tokens))
            needed += max(0, end_pages - start)
            if first < len(table) and table[first] != NULL_PAGE and self.ref_count[table[first]] > 1:
                needed += 1
        return needed

    def grow(self, seq: Sequence, num_new_tokens: int) -> list[PageCopy]:
        """Make the slots of seq's next `num_new_tokens` tokens writable; returns the copy-on-write copies."""
        cows = []
        first = seq.num_computed_tokens // self.page_size
        end_pages = self.pages_needed(seq.num_computed_tokens + num_new_tokens)
        for g, table in enumerate(seq.block_tables):
            if first < len(table) and table[first] != NULL_PAGE and self.ref_count[table[first]] > 1:
                page, new_page = table[first], self.allocate_page()
                self.release_page(page)
                table[first] = new_page
                self.num_cow_copies += 1
                cows.append(PageCopy(page, new_page))
            skip = self.first_block(g, seq.num_computed_tokens)  # blocks its queries never read
            while len(table) < end_pages:
                table.append(NULL_PAGE if len(table) < skip else self.allocate_page())
        return cows

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every page of the parent (parallel sampling)."""
        for table in parent.block_tables:
            for p in table:
                if p != NULL_PAGE:
                    self.acquire_page(p)
        child.block_tables = [list(t) for t in parent.block_tables]
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def free_sequence(self, seq: Sequence) -> None:
        for table in seq.block_tables:
            for p in reversed(table):  # the tail first, so the LRU keeps a prefix's head longest
                if p != NULL_PAGE:
                    self.release_page(p)
        seq.block_tables = [[] for _ in range(self.num_groups)]
        seq.block_hashes = []

    def register_full_pages(self, seq: Sequence, num_tokens: int) -> None:
        """Hash the pages of seq that its first `num_tokens` tokens fill, so other sequences can reuse them.

        The scheduler calls this with the tokens computed by the end of the step being planned: a page whose
        K/V is written in this step can already serve a sequence admitted in the same step, because every layer
        writes the step's new K/V before any sequence attends."""
        if not self.prefix_sharing:
            return
        P = self.page_size
        full = min(num_tokens // P, len(seq.block_tables[0]))
        if len(seq.block_hashes) >= full:
            return  # the common case, every step of every decode: nothing newly full
        tokens = seq.token_ids
        while len(seq.block_hashes) < full:
            i = len(seq.block_hashes)
            chunk = tuple(tokens[i * P : (i + 1) * P])
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else None, chunk)
            seq.block_hashes.append(h)
            for g, table in enumerate(seq.block_tables):
                if i < len(table) and table[i] != NULL_PAGE:
                    self._register(g, h, table[i], chunk)

    # ---- CPU swap pool --------------------------------------------------------------------------------------
    @property
    def num_free_cpu_pages(self) -> int:
        return len(self._cpu_free)

    def can_swap_out(self, seq: Sequence) -> bool:
        return seq.num_held_pages() <= len(self._cpu_free)

    def swap_out(self, seq: Sequence) -> list[PageCopy]:
        """Move seq's pages to CPU pages; returns (accelerator page, CPU page) copies to make *before* any
        accelerator page freed here is reused. A shared page gets a private CPU copy; the other holders keep it."""
        copies = []
        seq.cpu_block_tables = []
        for table in seq.block_tables:
            cpu_table = []
            for page in table:
                if page == NULL_PAGE:
                    cpu_table.append(NULL_PAGE)
                    continue
                cpu_page = self._cpu_free.popleft()
                self.cpu_ref_count[cpu_page] = 1
                copies.append(PageCopy(page, cpu_page))
                cpu_table.append(cpu_page)
            seq.cpu_block_tables.append(cpu_table)
        hashes = seq.block_hashes
        self.free_sequence(seq)
        seq.block_hashes = hashes  # the tokens did not change; the chain stays valid for re-registration
        return copies

    def num_pages_to_swap_in(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free pages that bringing seq back and computing its next tokens takes."""
        end_pages = self.pages_needed(seq.num_computed_tokens + num_new_tokens)
        return sum(
            sum(1 for p in t if p != NULL_PAGE) + max(0, end_pages - len(t)) for t in seq.cpu_block_tables
        )

    def swap_in(self, seq: Sequence) -> list[PageCopy]:
        """Move seq's CPU pages back to fresh accelerator pages; returns (CPU page, accelerator page) copies."""
        copies = []
        seq.block_tables = []
        for cpu_table in seq.cpu_block_tables:
            table = []
            for cpu_page in cpu_table:
                if cpu_page == NULL_PAGE:
                    table.append(NULL_PAGE)
                    continue
                copies.append(PageCopy(cpu_page, self.allocate_page()))
                self.cpu_ref_count[cpu_page] = 0
                self._cpu_free.append(cpu_page)
                table.append(copies[-1].dst)
            seq.block_tables.append(table)
        seq.cpu_block_tables = [[] for _ in range(self.num_groups)]
        # The swapped-in pages are private copies; re-register them only where the hash is not taken.
        if self.prefix_sharing:
            tokens, P = seq.token_ids, self.page_size
            for i, h in enumerate(seq.block_hashes):
                for g, table in enumerate(seq.block_tables):
                    if i < len(table) and table[i] != NULL_PAGE:
                        self._register(g, h, table[i], tuple(tokens[i * P : (i + 1) * P]))
        return copies

    def free_cpu_pages(self, seq: Sequence) -> None:
        """Drop a swapped sequence's CPU pages (an aborted request)."""
        for cpu_table in seq.cpu_block_tables:
            for cpu_page in cpu_table:
                if cpu_page != NULL_PAGE:
                    self.cpu_ref_count[cpu_page] = 0
                    self._cpu_free.append(cpu_page)
        seq.cpu_block_tables = [[] for _ in range(self.num_groups)]
        seq.block_hashes = []

    # ---- checks ----------------------------------------------------------------------------------------------
    def check_integrity(self, sequences: Iterable[Sequence] = ()) -> None:
        """free + used == total in both pools, and every reference count equals the number of block tables
        (of `sequences`: pass every live sequence) that hold the page. Raises AssertionError."""
        free = list(self._free_uncached) + list(self._free_cached)
        assert len(free) == len(set(free)), "a page is on a free list twice"
        assert all(self.ref_count[p] == 0 for p in free), "a free page has references"
        used = [p for p in range(self.num_pages) if self.ref_count[p] > 0]
        assert len(used) + len(free) == self.num_pages, (
            f"free {len(free)} + used {len(used)} != total {self.num_pages}"
        )
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
            for table in seq.cpu_block_tables:
                for p in table:
                    if p != NULL_PAGE:
                        expected_cpu[p] += 1
        assert expected == self.ref_count, "reference counts differ from the block tables"
        assert expected_cpu == self.cpu_ref_count, "CPU page references differ from the CPU block tables"
        assert all(len(g) == 1 for g in groups_of_page.values()), "a page is held by two groups"
        cpu_free = set(self._cpu_free)
        assert len(cpu_free) == len(self._cpu_free)
        assert all(self.cpu_ref_count[p] == 0 for p in cpu_free)
        assert len(cpu_free) + sum(1 for c in self.cpu_ref_count if c) == self.num_cpu_pages
        for page, h in self.page_hash.items():
            assert self.hash_to_page.get((self.page_group[page], h)) == page, "hash index out of step"
