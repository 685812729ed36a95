"""Pure integer bookkeeping of KV pages: free lists, reference counts, prefix hashes and CPU swap slots.

No tensors here. The accelerator pool has `num_pages` pages of `page_size` token slots; the CPU pool has
`num_cpu_pages`. A page's reference count is the number of block tables holding it. A freed page that carries
a prefix hash keeps its contents and can be revived by a later sequence until the allocator reuses it; free
pages without a hash are handed out before pages with one; among those with a hash, the least recently freed
first (so a popular prefix survives longest).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import NamedTuple

from .sequence import Sequence


class PageCopy(NamedTuple):
    src: int
    dst: int


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the pages that `a` tokens fill at `b` tokens a page."""
    return -(-a // b)


def chain_hash(prev_hash: int | None, tokens: Iterable[int]) -> int:
    """Hash of a full page, chained over every token before it (through prev_hash) and in it."""
    return hash((prev_hash, tuple(tokens)))


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, num_cpu_pages: int = 0, prefix_sharing: bool = True):
        if num_pages < 1:
            raise ValueError("the accelerator pool needs at least one page")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_cpu_pages = num_cpu_pages
        self.prefix_sharing = prefix_sharing
        self.ref_count = [0] * num_pages
        # a stack: the page freed last is handed out first, so the pages ever touched (and the process's memory
        # on the CPU, where the pool is lazily zeroed) stay at the peak in use, not the whole pool
        self._free_uncached: list[int] = list(range(num_pages - 1, -1, -1))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # oldest-freed first
        self.page_hash: dict[int, int] = {}  # page -> hash, for full pages with known contents
        self.page_tokens: dict[int, tuple[int, ...]] = {}  # page -> its tokens, to rule out collisions
        self.hash_to_page: dict[int, int] = {}
        self.cpu_ref_count = [0] * num_cpu_pages
        self._cpu_free: deque[int] = deque(range(num_cpu_pages))
        # counters for statistics
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_cow_copies = 0

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
        if h is not None and self.hash_to_page.get(h) == page:
            del self.hash_to_page[h]

    # ---- sequences ----------------------------------------------------------------------------------------
    def pages_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.page_size)

    def match_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Cached pages (and their hashes) that hold a prefix of seq's tokens. The last token is never matched:
        its logits are needed, so at least one token of the prompt is always computed."""
        if not self.prefix_sharing or seq.prompt_logprobs is not None:
            return [], []  # a sequence scoring its prompt computes all of it
        tokens = seq.token_ids
        P = self.page_size
        pages, hashes = [], []
        prev = None
        for i in range((len(tokens) - 1) // P):
            chunk = tuple(tokens[i * P : (i + 1) * P])
            h = chain_hash(prev, chunk)
            page = self.hash_to_page.get(h)
            if page is None or self.page_tokens.get(page) != chunk:
                break
            pages.append(page)
            hashes.append(h)
            prev = h
        return pages, hashes

    def num_new_pages_for_admission(
        self, seq: Sequence, match: tuple[list[int], list[int]] | None = None
    ) -> int:
        """Free pages that admitting `seq` (all its uncomputed tokens) takes, prefix-cache hits deducted.
        A hit on a free cached page still takes that page off the free list. `match`: match_prefix(seq), when
        the caller has it already."""
        pages, _ = match if match is not None else self.match_prefix(seq)
        revived = sum(1 for p in pages if self.ref_count[p] == 0)
        return self.pages_needed(seq.num_tokens) - len(pages) + revived

    def allocate_sequence(
        self, seq: Sequence, max_new_tokens: int, match: tuple[list[int], list[int]] | None = None
    ) -> int:
        """Admit a waiting sequence: reuse its cached prefix pages, then give it pages for its next uncomputed
        tokens, at most `max_new_tokens` of them (a chunk, or the whole prompt). Returns how many."""
        assert not seq.block_table
        pages, hashes = match if match is not None else self.match_prefix(seq)
        for p in pages:
            self.acquire_page(p)
        seq.block_table = list(pages)
        seq.block_hashes = list(hashes)
        seq.num_computed_tokens = len(pages) * self.page_size
        self.prefix_query_tokens += seq.num_tokens
        self.prefix_hit_tokens += seq.num_computed_tokens
        n = min(max_new_tokens, seq.num_uncomputed_tokens)
        cow = self.grow(seq, n)
        assert cow is None, "a new sequence never writes into a shared page"
        return n

    def num_pages_to_grow(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free pages that computing seq's next `num_new_tokens` tokens takes: new pages past the end of its
        block table, plus a private copy when the first page written into is shared (copy-on-write)."""
        first = seq.num_computed_tokens // self.page_size
        needed = max(0, self.pages_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))
        if first < len(seq.block_table) and self.ref_count[seq.block_table[first]] > 1:
            needed += 1
        return needed

    def grow(self, seq: Sequence, num_new_tokens: int) -> PageCopy | None:
        """Make the slots of seq's next `num_new_tokens` tokens writable; returns the copy-on-write to make."""
        cow = None
        first = seq.num_computed_tokens // self.page_size
        if first < len(seq.block_table) and self.ref_count[seq.block_table[first]] > 1:
            page, new_page = seq.block_table[first], self.allocate_page()
            self.release_page(page)
            seq.block_table[first] = new_page
            self.num_cow_copies += 1
            cow = PageCopy(page, new_page)
        while len(seq.block_table) < self.pages_needed(seq.num_computed_tokens + num_new_tokens):
            seq.block_table.append(self.allocate_page())
        return cow

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every page of the parent (parallel sampling)."""
        for p in parent.block_table:
            self.acquire_page(p)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def free_sequence(self, seq: Sequence) -> None:
        for p in reversed(seq.block_table):  # the tail first, so the LRU keeps a prefix's head longest
            self.release_page(p)
        seq.block_table = []
        seq.block_hashes = []

    def register_full_pages(self, seq: Sequence, num_tokens: int) -> None:
        """Hash the pages of seq that its first `num_tokens` tokens fill, so other sequences can reuse them.

        The scheduler calls this with the tokens computed by the end of the step being planned: a page whose
        K/V is written in this step can already serve a sequence admitted in the same step, because every layer
        writes the step's new K/V before any sequence attends."""
        if not self.prefix_sharing:
            return
        P = self.page_size
        full = min(num_tokens // P, len(seq.block_table))
        if len(seq.block_hashes) >= full:
            return  # the common case, every step of every decode: nothing newly full
        tokens = seq.token_ids
        while len(seq.block_hashes) < full:
            i = len(seq.block_hashes)
            chunk = tuple(tokens[i * P : (i + 1) * P])
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else None, chunk)
            seq.block_hashes.append(h)
            page = seq.block_table[i]
            if h not in self.hash_to_page and page not in self.page_hash:
                self.hash_to_page[h] = page
                self.page_hash[page] = h
                self.page_tokens[page] = chunk

    # ---- CPU swap pool --------------------------------------------------------------------------------------
    @property
    def num_free_cpu_pages(self) -> int:
        return len(self._cpu_free)

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= len(self._cpu_free)

    def swap_out(self, seq: Sequence) -> list[PageCopy]:
        """Move seq's pages to CPU pages; returns (accelerator page, CPU page) copies to make *before* any
        accelerator page freed here is reused. A shared page gets a private CPU copy; the other holders keep it."""
        copies = []
        for page in seq.block_table:
            cpu_page = self._cpu_free.popleft()
            self.cpu_ref_count[cpu_page] = 1
            copies.append(PageCopy(page, cpu_page))
        seq.cpu_block_table = [c.dst for c in copies]
        hashes = seq.block_hashes
        self.free_sequence(seq)
        seq.block_hashes = hashes  # the tokens did not change; the chain stays valid for re-registration
        return copies

    def swap_in(self, seq: Sequence) -> list[PageCopy]:
        """Move seq's CPU pages back to fresh accelerator pages; returns (CPU page, accelerator page) copies."""
        copies = []
        for cpu_page in seq.cpu_block_table:
            copies.append(PageCopy(cpu_page, self.allocate_page()))
            self.cpu_ref_count[cpu_page] = 0
            self._cpu_free.append(cpu_page)
        seq.block_table = [c.dst for c in copies]
        seq.cpu_block_table = []
        # The swapped-in pages are private copies; re-register them only where the hash is not taken.
        hashes, seq.block_hashes = seq.block_hashes, []
        tokens = seq.token_ids
        for h, page in zip(hashes, seq.block_table):
            seq.block_hashes.append(h)
            if self.prefix_sharing and h not in self.hash_to_page:
                self.hash_to_page[h] = page
                self.page_hash[page] = h
                i = len(seq.block_hashes) - 1
                self.page_tokens[page] = tuple(tokens[i * self.page_size : (i + 1) * self.page_size])
        return copies

    def free_cpu_pages(self, seq: Sequence) -> None:
        """Drop a swapped sequence's CPU pages (an aborted request)."""
        for cpu_page in seq.cpu_block_table:
            self.cpu_ref_count[cpu_page] = 0
            self._cpu_free.append(cpu_page)
        seq.cpu_block_table = []
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
        for seq in sequences:
            for p in seq.block_table:
                expected[p] += 1
            for p in seq.cpu_block_table:
                expected_cpu[p] += 1
        assert expected == self.ref_count, "reference counts differ from the block tables"
        assert expected_cpu == self.cpu_ref_count, "CPU page references differ from the CPU block tables"
        cpu_free = set(self._cpu_free)
        assert len(cpu_free) == len(self._cpu_free)
        assert all(self.cpu_ref_count[p] == 0 for p in cpu_free)
        assert len(cpu_free) + sum(1 for c in self.cpu_ref_count if c) == self.num_cpu_pages
        for page, h in self.page_hash.items():
            assert self.hash_to_page.get(h) == page, "hash index out of step"
