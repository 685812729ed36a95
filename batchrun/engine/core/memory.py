"""What the KV cache holds right now, counted two ways: from the block tables (every step) and slot by slot
(`BATCHRUN_DEBUG_STATS=1`, to prove the first). P is the page size; sums run over the running sequences, the
ones holding accelerator pages (swapped sequences hold CPU pages), and over their block tables, one per KV cache
group (a model whose layers attend alike has one). A token slot is one token of one group's layers."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchrun.engine.core.block_manager import BlockManager
from batchrun.engine.core.kv_coordinator import KVCacheCoordinator
from batchrun.engine.core.sequence import NULL_PAGE, Sequence


@dataclass(frozen=True)
class MemorySnapshot:
    num_running: int
    num_waiting: int
    num_swapped: int
    page_size: int
    pages_total: int
    pages_used: int  # physical pages in the running sequences' block tables, each once
    pages_allocatable: int  # pages on the allocator's free lists (counted apart from the block tables)
    tokens_stored: int  # tokens whose K/V is in the cache, each physical slot once
    logical_pages: int  # sum of block-table lengths, entries given back behind a window not counted
    tokens_cached_per_sequence: int  # sum of computed tokens held, shared ones counted for every sequence
    reserved_slots_contiguous: int  # what prompt + max_new_tokens reservations would hold for them
    window_freed_pages: int  # block-table entries given back because they fell behind their group's window
    prefix_query_tokens: int  # counters since the engine started
    prefix_hit_tokens: int
    cow_copies: int
    # each manager's usage columns by name (KVCacheCoordinator.usage: a hybrid's state_slots_total and
    # state_slots_used); empty for a model with pages alone
    usage: dict[str, int] = field(default_factory=dict)

    @property
    def pages_free(self) -> int:
        return self.pages_total - self.pages_used

    @property
    def slots_allocated(self) -> int:
        return self.pages_used * self.page_size

    @property
    def internal_waste_slots(self) -> int:
        return self.slots_allocated - self.tokens_stored

    @property
    def shared_pages_saved(self) -> int:
        return self.logical_pages - self.pages_used

    @property
    def external_fragmentation(self) -> float:
        """Free pages the allocator could not hand out, over free pages: 0 for paging, counted, not assumed."""
        return (self.pages_free - self.pages_allocatable) / self.pages_free if self.pages_free else 0.0


def count(
    kv: KVCacheCoordinator,
    running: list[Sequence],
    num_waiting: int,
    num_swapped: int,
    reserved_slots: int,
    computed: int,
) -> MemorySnapshot:
    """From the block tables: a page holds min(P, computed tokens past its start) of each holder's tokens.
    `reserved_slots`: what contiguous reservations for
    the running sequences would hold (Engine.reserved_slots of them); `computed`: their computed tokens summed
    (both kept as running sums by the scheduler, so a step's count passes over no sequence where none is shared
    and no group has a window)."""
    if kv.bm.pool.num_shared:
        counted = _count_shared(kv.bm, running)
    else:
        counted = _count_unshared(kv.bm, running, computed)
    counted["reserved_slots_contiguous"] = reserved_slots
    return _snapshot(kv, kv.usage(running), running, num_waiting, num_swapped, **counted)


def _count_shared(bm: BlockManager, running: list[Sequence]) -> dict[str, int]:
    """`count` where pages are shared: every step, so it touches one page per sequence in Python: a sequence's
    pages before its computed end are full for every holder (set unions, in C), the page holding that end is
    partly filled, the rest are empty; a page's count is its fullest holder's."""
    P = bm.page_size
    used: set[int] = set()  # physical pages in the block tables
    full: set[int] = set()  # pages some holder has filled
    partial: dict[int, int] = {}  # page -> computed tokens in it, for the page where a holder's tokens end
    logical_pages = cached = freed = 0
    for seq in running:
        computed = seq.num_computed_tokens
        k, rest = divmod(computed, P)
        for table in bm.block_tables(seq):
            # entries given back (NULL) are a run of full pages at the head of a windowed group's table
            null = table.count(NULL_PAGE) if bm.layout.windowed else 0
            held = table[null:]
            freed += null
            logical_pages += len(held)
            used.update(held)
            full.update(table[null:k])
            if rest and k < len(table) and partial.get(table[k], 0) < rest:
                partial[table[k]] = rest
            cached += computed - null * P
    return dict(
        pages_used=len(used),
        tokens_stored=P * len(full) + sum(n for page, n in partial.items() if page not in full),
        logical_pages=logical_pages,
        tokens_cached_per_sequence=cached,
        window_freed_pages=freed,
    )


def _count_unshared(bm: BlockManager, running: list[Sequence], computed: int) -> dict[str, int]:
    """`count` while no page is held by two tables (the pool counts those): every page in the tables is
    distinct and holds its own table's tokens, P for each page but the one a computed end falls in, less P for
    each entry given back behind a window (always before that end). A running sequence's tables cover its
    computed tokens (its pages are taken before they are computed), so its tables of a group hold its c computed
    tokens: the sums need the sequences' computed counts summed (`computed`, the scheduler's running sum) and the
    block manager's count of table entries (kept as the tables change), not a pass over each table."""
    P, records = bm.page_size, bm.sequences
    freed = (
        sum([t.count(NULL_PAGE) for seq in running for t in records[seq.seq_id].tables])
        if bm.layout.windowed
        else 0
    )
    logical_pages = bm.num_table_entries - freed  # only running sequences' tables hold entries
    cached = bm.num_groups * computed - freed * P
    return dict(
        pages_used=logical_pages,
        tokens_stored=cached,
        logical_pages=logical_pages,
        tokens_cached_per_sequence=cached,
        window_freed_pages=freed,
    )


def recount(
    kv: KVCacheCoordinator, running: list[Sequence], num_waiting: int, num_swapped: int, reserved_slots
) -> MemorySnapshot:
    """The same by brute force: mark every slot that holds a computed token, count holders page by page (each
    manager's usage recounted sequence by sequence)."""
    bm = kv.bm
    P = bm.page_size
    slot_holds_token = [[False] * P for _ in range(bm.num_pages)]
    holders: dict[int, int] = {}
    cached = freed = 0
    for seq in running:
        for table in bm.block_tables(seq):
            for pos in range(seq.num_computed_tokens):
                page = table[pos // P]
                if page != NULL_PAGE:
                    slot_holds_token[page][pos % P] = True
                    cached += 1
            for page in table:
                if page == NULL_PAGE:
                    freed += 1
                else:
                    holders[page] = holders.get(page, 0) + 1
    return _snapshot(
        kv,
        kv.usage(running, recount=True),
        running,
        num_waiting,
        num_swapped,
        pages_used=len(holders),
        pages_allocatable=sum(1 for c in bm.pool.ref_count if c == 0),
        tokens_stored=sum(sum(slots) for slots in slot_holds_token),
        logical_pages=sum(holders.values()),
        tokens_cached_per_sequence=cached,
        reserved_slots_contiguous=reserved_slots(running),
        window_freed_pages=freed,
    )


def _snapshot(
    kv: KVCacheCoordinator,
    usage: dict[str, int],
    running: list[Sequence],
    num_waiting: int,
    num_swapped: int,
    **counted: int,
) -> MemorySnapshot:
    """A snapshot of what was counted, with the queue sizes and the block manager's own counters (and, unless
    recounted, the free pages as it counts them), and each manager's usage columns."""
    bm = kv.bm
    counted.setdefault("pages_allocatable", bm.num_free_pages)
    return MemorySnapshot(
        num_running=len(running),
        num_waiting=num_waiting,
        num_swapped=num_swapped,
        page_size=bm.page_size,
        pages_total=bm.num_pages,
        prefix_query_tokens=bm.prefix_cache.query_tokens,
        prefix_hit_tokens=bm.prefix_cache.hit_tokens,
        cow_copies=bm.num_cow_copies,
        usage=usage,
        **counted,
    )
