"""The prefix cache: full pages indexed by the chain hash of their tokens (and every token before them), so a
sequence whose prompt starts like an earlier one's reuses its pages instead of computing them again.

The index itself lives in the page pool (page_pool.PagePool.register / cached): a page given back stays indexed
while it waits on the free list, until it is handed out again. This module hashes sequences' pages, finds the
longest cached prefix every KV cache group can use, and counts what it found for the statistics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from batchrun.engine.core.page_pool import PageLayout, PagePool, chain_hash
from batchrun.engine.core.sequence import NULL_PAGE, Sequence


class PrefixMatch(NamedTuple):
    """Cached pages holding a prefix of a sequence: `num_blocks` full pages, each group's table for them
    (NULL where a windowed group no longer needs the page) and the pages' hashes."""

    num_blocks: int
    tables: list[list[int]]
    hashes: list[bytes]
    prompt_hashes: list[
        bytes
    ] = []  # every full page's hash that could be matched (the last token's excluded)


class PrefixCache:
    """Finds and indexes cached prefixes in `pool` for the block manager (`enabled`: the engine's
    prefix_sharing); `pages_of(seq)`: the block manager's record of a sequence (SequencePages: its tables and hash chain).
    `query_tokens` and `hit_tokens` count the prompt tokens admitted and those found here."""

    def __init__(
        self,
        pool: PagePool,
        layout: PageLayout,
        pages_of: Callable[[Sequence], Any],  # block_manager.SequencePages (it imports this module)
        enabled: bool = True,
    ):
        self.pool, self.layout, self.pages_of, self.enabled = pool, layout, pages_of, enabled
        self.query_tokens = 0
        self.hit_tokens = 0
        # seq -> how many of its leading tokens hold K/V that every sequence of the same tokens computes, the
        # only pages matched and indexed (RoPE factors per sequence: PerSequenceRope.shareable_tokens, which
        # never grows for a sequence); None: all of them
        self.shareable_tokens = None

    def _no_tables(self) -> list[list[int]]:
        return [[] for _ in range(self.layout.num_groups)]

    def _hash_pages(self, seq: Sequence, n: int) -> list[bytes]:
        """seq's one hash chain (SequencePages.hash_chain) extended to its first n full pages; returns it. Its
        tokens are only ever appended, so pages hashed before stay valid (through preemption too)."""
        chain, P = self.pages_of(seq).hash_chain, self.layout.page_size
        if len(chain) < n:
            tokens = seq.cache_key_tokens
            for i in range(len(chain), n):
                chain.append(chain_hash(chain[-1] if chain else seq.cache_salt, tokens[i * P : (i + 1) * P]))
        return chain

    def _shareable_pages(self, seq: Sequence, n: int) -> int:
        """n, or fewer: seq's leading pages that may be shared (`shareable_tokens`)."""
        if self.shareable_tokens is None:
            return n
        return min(n, self.shareable_tokens(seq) // self.layout.page_size)

    def page_hashes(self, seq: Sequence) -> list[bytes]:
        """The chain hash of each full page of seq's tokens but the one holding its last token (which is never
        matched: its logits are needed)."""
        n = (seq.num_tokens - 1) // self.layout.page_size
        return self._hash_pages(seq, n)[:n]

    def match(self, seq: Sequence, usable=None) -> PrefixMatch:
        """Cached pages that hold a prefix of seq's tokens, in every group (a windowed group only the pages its
        window still reads at the prefix's end). The last token is never matched: its logits are needed, so at
        least one token of the prompt is always computed. `usable(hashes, k)`: whether a prefix of k pages may
        be used (a hybrid model needs its layers' state at the prefix's end too). Only seq's shareable pages
        (`shareable_tokens`) are looked up."""
        if not self.enabled or seq.prompt_logprobs is not None:
            return PrefixMatch(0, self._no_tables(), [])  # a scoring sequence computes all
        tokens, P, G = seq.cache_key_tokens, self.layout.page_size, self.layout.num_groups
        hashes = self.page_hashes(seq)
        chunks = [tuple(tokens[i * P : (i + 1) * P]) for i in range(self._shareable_pages(seq, len(hashes)))]
        # per group, its cached pages and the last block before each k that is not cached (-1: none); then the
        # longest prefix k for which every group holds the blocks it reads: those from first_block(g, k * P) on
        pages = [[self.pool.cached(g, h, c) for h, c in zip(hashes, chunks)] for g in range(G)]
        last_miss = []
        for group_pages in pages:
            latest, misses = -1, []
            for i, page in enumerate(group_pages):
                latest = i if page is None else latest
                misses.append(latest)
            last_miss.append(misses)
        first_block = self.layout.first_block
        for k in range(len(chunks), 0, -1):
            firsts = [first_block(g, k * P) for g in range(G)]
            if all(last_miss[g][k - 1] < firsts[g] for g in range(G)) and (
                usable is None or usable(hashes, k)
            ):
                tables = [[NULL_PAGE] * f + pages[g][f:k] for g, f in enumerate(firsts)]
                return PrefixMatch(k, tables, hashes[:k], hashes)
        return PrefixMatch(0, self._no_tables(), [], hashes)

    def register_full_pages(self, seq: Sequence, num_tokens: int) -> None:
        """Hash the pages of seq that its first `num_tokens` tokens fill, so other sequences can reuse them.

        The scheduler calls this with the tokens computed by the end of the step being planned: a page whose
        K/V is written in this step can already serve a sequence admitted in the same step, because every layer
        writes the step's new K/V before any sequence attends."""
        if not self.enabled:
            return
        entry = self.pages_of(seq)
        full = min(num_tokens // self.layout.page_size, len(entry.tables[0]))
        start = entry.num_registered
        if start >= full:
            return  # the common case, every step of every decode: nothing newly full
        self._hash_pages(seq, full)
        entry.num_registered = full
        self.register(seq, start)

    def register(self, seq: Sequence, start: int = 0) -> None:
        """Index seq's hashed pages from block `start` on, in every group that holds them (also after a swap-in:
        the swapped-in pages are private copies, indexed only where the hash is not taken)."""
        if not self.enabled:
            return
        entry, tokens, P = self.pages_of(seq), seq.cache_key_tokens, self.layout.page_size
        for i in range(start, self._shareable_pages(seq, entry.num_registered)):
            for g, table in enumerate(entry.tables):
                if i < len(table) and table[i] != NULL_PAGE:
                    self.pool.register(g, entry.hash_chain[i], table[i], tuple(tokens[i * P : (i + 1) * P]))
