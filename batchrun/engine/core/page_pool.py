"""The two page pools under the block manager: accelerator pages (reference counts, free lists and the index of
page contents that prefix sharing reuses) and CPU swap slots. Pure integers, no tensors; the block tables that
hold the pages are the block manager's (block_manager.py).

A page's reference count is the number of block tables holding it. A freed page that carries a prefix hash keeps
its contents and can be revived by a later sequence until the pool reuses it; free pages without a hash are
handed out before pages with one; among those with a hash, the least recently freed first (so a popular prefix
survives longest).
"""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator

from batchrun.engine.core.sequence import NULL_PAGE


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the pages that `a` tokens fill at `b` tokens a page."""
    return -(-a // b)


def chain_hash(prev_hash: bytes | None, tokens: Iterable[int]) -> bytes:
    """Hash of a full page, chained over every token before it (through prev_hash) and in it: SHA-256, so two
    different prefixes never meet on one hash (Python's 64-bit `hash()` of a tuple can collide, and a collision
    of the chain would share another prefix's K/V: the page's own tokens are checked, not those before it)."""
    return hashlib.sha256((prev_hash or b"") + array.array("q", tokens).tobytes()).digest()


class PagePool:
    """The accelerator's `num_pages` pages: who holds each, which are free, and what the full ones hold."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError("the accelerator pool needs at least one page")
        self.num_pages = num_pages
        self.ref_count = [0] * num_pages
        # pages held by more than one block table (prefix sharing, forks): while there are none, what the cache
        # holds follows from each table's length alone (memory.count's short cut)
        self.num_shared = 0
        # a stack: the page freed last is handed out first, so the pages ever touched (and the process's memory
        # on the CPU, where the pool is lazily zeroed) stay at the peak in use, not the whole pool
        self._free_uncached: list[int] = list(range(num_pages - 1, -1, -1))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # oldest-freed first
        self.page_hash: dict[int, bytes] = {}  # page -> hash, for full pages with known contents
        self.page_tokens: dict[int, tuple[int, ...]] = {}  # page -> its tokens, to rule out collisions
        self.page_group: dict[int, int] = {}  # page -> KV cache group, for pages with a hash
        self._hash_to_page: dict[tuple[int, bytes], int] = {}  # (group, hash) -> page

    @property
    def num_free(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    def allocate(self) -> int:
        if self._free_uncached:
            page = self._free_uncached.pop()
        elif self._free_cached:
            page, _ = self._free_cached.popitem(last=False)
            self._forget(page)
        else:
            raise RuntimeError("no free page: the scheduler must check before allocating")
        assert self.ref_count[page] == 0
        self.ref_count[page] = 1
        return page

    def acquire(self, page: int) -> None:
        """Add a reference to a page in use, or revive a free cached page."""
        if self.ref_count[page] == 0:
            del self._free_cached[page]
        elif self.ref_count[page] == 1:
            self.num_shared += 1
        self.ref_count[page] += 1

    def release(self, page: int) -> None:
        assert self.ref_count[page] > 0, f"page {page} released more often than held"
        self.ref_count[page] -= 1
        if self.ref_count[page] == 1:
            self.num_shared -= 1
        elif self.ref_count[page] == 0:
            if page in self.page_hash:
                self._free_cached[page] = None
            else:
                self._free_uncached.append(page)

    def acquire_tables(self, tables: list[list[int]]) -> None:
        for p in held_pages(tables):
            self.acquire(p)

    def release_tables(self, tables: list[list[int]]) -> None:
        for table in tables:
            for p in reversed(table):  # the tail first, so the LRU keeps a prefix's head longest
                if p != NULL_PAGE:
                    self.release(p)

    def register(self, group: int, h: bytes, page: int, tokens: tuple[int, ...]) -> None:
        """Record that `page` of `group` holds the full page of `tokens` whose chained hash is `h` (unless the
        hash or the page is known already)."""
        if (group, h) not in self._hash_to_page and page not in self.page_hash:
            self._hash_to_page[(group, h)] = page
            self.page_hash[page] = h
            self.page_group[page] = group
            self.page_tokens[page] = tokens

    def cached(self, group: int, h: bytes, tokens: tuple[int, ...]) -> int | None:
        """The page of `group` holding `tokens` (hash `h`), in use or free, if the pool still has one."""
        page = self._hash_to_page.get((group, h))
        return page if page is not None and self.page_tokens.get(page) == tokens else None

    def _forget(self, page: int) -> None:
        h = self.page_hash.pop(page, None)
        self.page_tokens.pop(page, None)
        group = self.page_group.pop(page, None)
        if h is not None and self._hash_to_page.get((group, h)) == page:
            del self._hash_to_page[(group, h)]

    def check(self, expected_refs: list[int]) -> None:
        """free + used == total, and each page's count equals `expected_refs` (counted from the block tables)."""
        free = list(self._free_uncached) + list(self._free_cached)
        assert len(free) == len(set(free)), "a page is on a free list twice"
        assert all(self.ref_count[p] == 0 for p in free), "a free page has references"
        used = [p for p in range(self.num_pages) if self.ref_count[p] > 0]
        assert len(used) + len(free) == self.num_pages, (
            f"free {len(free)} + used {len(used)} != total {self.num_pages}"
        )
        assert expected_refs == self.ref_count, "reference counts differ from the block tables"
        assert self.num_shared == sum(1 for c in self.ref_count if c > 1), "shared-page count out of step"
        for page, h in self.page_hash.items():
            assert self._hash_to_page.get((self.page_group[page], h)) == page, "hash index out of step"


def held_pages(tables: list[list[int]]) -> Iterator[int]:
    """The pages `tables` hold (their entries but NULL_PAGE), table by table."""
    for table in tables:
        yield from (p for p in table if p != NULL_PAGE)


class CpuPagePool:
    """The CPU's `num_pages` swap slots. A swapped-out page always gets a private slot, so a slot has one holder."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.ref_count = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        page = self._free.popleft()
        self.ref_count[page] = 1
        return page

    def release(self, page: int) -> None:
        self.ref_count[page] = 0
        self._free.append(page)

    def check(self, expected_refs: list[int]) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a CPU page is on the free list twice"
        assert all(self.ref_count[p] == 0 for p in free), "a free CPU page has references"
        assert len(free) + sum(1 for c in self.ref_count if c) == self.num_pages, "CPU pages lost"
        assert expected_refs == self.ref_count, "CPU page references differ from the CPU block tables"


class PageLayout:
    """How many pages a sequence's tables hold: `page_size` tokens a page, and per KV cache group the first key
    position a query at a given position sees (`first_keys`, MaskKind.first_key; None: one full-attention
    group)."""

    def __init__(self, page_size: int, first_keys: list[Callable[[int], int]] | None = None):
        self.page_size = page_size
        self.first_keys = list(first_keys) if first_keys else [lambda pos: 0]
        self.num_groups = len(self.first_keys)
        self.windowed = any(fk(1 << 40) > 0 for fk in self.first_keys)  # some group gives pages back

    def pages_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.page_size)

    def first_block(self, group: int, pos: int) -> int:
        """The first block of `group` that queries at positions >= pos still read."""
        return self.first_keys[group](pos) // self.page_size

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
