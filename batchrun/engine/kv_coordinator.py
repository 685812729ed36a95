"""The KV cache coordinator: one owner of what a sequence holds in the cache, whatever the kind (vLLM v1's
`KVCacheCoordinator`).

A sequence holds pages in every KV cache group (block_manager.py, with the prefix cache and the CPU swap pages)
and, in a hybrid model, a state slot for its stateful layers (state_slots.py, with the prefix snapshots). Each
of the scheduler's actions (admit, grow, finish, drop for recompute, swap out, swap in, fork, abort) must reach
every kind at once, in an order that keeps them consistent: a prefix is usable only where both kinds have it, a
sequence swaps out only where both have CPU room. This module is where that is written once, so the scheduler
calls one method per action and never holds two managers side by side. A model without stateful layers simply
has no state manager here (`states` is None).

Pure integers like its two managers: the tensors the copies it returns move are kv_cache.KVCache's and
state_cache.StateCache's, applied by the engine from the scheduler's plan.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice

from .block_manager import BlockManager
from .page_pool import PageCopy
from .prefix_cache import PrefixMatch
from .sequence import Sequence
from .state_slots import StateCopy, StateSlots


def _no_slot(seq: Sequence) -> int:
    return -1


def add_copy(copies: list[StateCopy], copy: StateCopy | None) -> None:
    """A state copy to a plan's list (None: a model without state slots, or nothing to copy)."""
    if copy is not None:
        copies.append(copy)


class KVCacheCoordinator:
    """Pages (`bm`) and, for a hybrid model, state slots (`states`; None: none) held as one resource per
    sequence.

    State copies that must wait for the step that computes their source (a fork's, a prefix snapshot's) are kept
    here until the next plan takes them (`new_step`)."""

    def __init__(self, block_manager: BlockManager, states: StateSlots | None = None):
        self.bm = block_manager
        self.states = states
        self.prefix_cache = block_manager.prefix_cache
        self.page_size = block_manager.page_size
        # asked of every scheduled sequence, every step: the managers' own methods and dict, not calls through
        # this object. slot_of: the state slot a sequence holds (-1: none, or a model without state slots);
        # snapshot_ends: seq_id -> the prefix (full pages) whose state it keeps when its prefill gets there, the
        # chunk rule's last cut (StateSlots only ever changes that dict in place; without state slots, empty)
        self.slot_of = states.slot_of if states is not None else _no_slot
        self.block_tables = block_manager.block_tables
        self.take_new_block_ids = block_manager.take_new_block_ids  # the runner's tables' news (the plan's)
        self.snapshot_ends: dict[int, int] = states.snapshot_ends if states is not None else {}
        # forks and snapshots since the last plan: copied first in the next
        self._pending: list[StateCopy] = []

    # ---- what the scheduler and the engine read ------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.bm.num_pages

    @property
    def num_state_slots(self) -> int:
        """A hybrid model's accelerator state slots (0: no stateful layers)."""
        return self.states.num_slots if self.states is not None else 0

    # ---- a step ---------------------------------------------------------------------------------------------
    def new_step(self) -> list[StateCopy]:
        """A plan begins: returns the state copies the last one left (forks, snapshots), to be made first."""
        pending, self._pending = self._pending, []
        if self.states is not None:
            self.states.new_step()
        return pending

    # ---- admission ------------------------------------------------------------------------------------------
    def match(self, seq: Sequence) -> PrefixMatch:
        """The longest cached prefix of seq that every kind holds: pages in every group and, for a hybrid, the
        state at its end (a snapshot)."""
        return self.prefix_cache.match(seq, self.states.usable if self.states is not None else None)

    def can_admit(self, seq: Sequence, match: PrefixMatch, max_chunk: int | None, reserve: int) -> bool:
        """Whether seq may be admitted behind `match` now: the pages its prompt takes (steps of at most
        `max_chunk` tokens) beside `reserve` free pages, its state slots, and no longer prefix of it being
        snapshotted this step (it waits one step for that rather than compute it twice)."""
        states = self.states
        if states is not None and states.snapshot_coming(match.prompt_hashes, match.num_blocks):
            return False
        need = self.bm.num_new_pages_for_admission(seq, match, max_chunk)
        if need + reserve > self.bm.num_free_pages:
            return False
        return states is None or states.seats(seq) <= states.num_free

    def keep_prefix_state(self, seq: Sequence, match: PrefixMatch, waiting: Iterable[Sequence]) -> None:
        """A hybrid keeping prefix states: the prefix of seq worth a snapshot, the longest it shares with one of
        the next `waiting` prompts (its prefill stops there once: `limit`)."""
        states = self.states
        if states is None or not states.num_snapshots:
            return
        page_hashes = self.prefix_cache.page_hashes
        theirs = [page_hashes(o) for o in islice(waiting, states.LOOKAHEAD)]
        states.choose_snapshot(seq, match.prompt_hashes, match.num_blocks, theirs)

    def admit(self, seq: Sequence, max_new_tokens: int, match: PrefixMatch) -> tuple[int, StateCopy | None]:
        """Give seq its state slots, its cached prefix pages and pages for its next `max_new_tokens` tokens at
        most. Returns how many tokens it computes and, for a hybrid behind a kept prefix, the copy of that
        prefix's state into its slot (for this plan)."""
        if self.states is not None:
            self.states.allocate(seq)
        n = self.bm.allocate_sequence(seq, max_new_tokens, match)
        restore = (
            self.states.restore(seq, match.hashes, match.num_blocks) if self.states is not None else None
        )
        return n, restore

    # ---- running --------------------------------------------------------------------------------------------
    def limit(self, seq: Sequence, start: int, n: int) -> int:
        """n, or fewer: a hybrid's step stops at the prefix whose state it keeps."""
        return self.states.limit(seq, start, n, self.page_size)

    def planned(self, seq: Sequence, end: int) -> None:
        """seq is planned up to `end` tokens: its full pages go into the prefix cache and, at the prefix whose
        state it keeps, the copy into a snapshot slot waits for the next plan."""
        self.prefix_cache.register_full_pages(seq, end)
        if seq.seq_id in self.snapshot_ends:
            hashes = self.prefix_cache.page_hashes(seq)
            add_copy(self._pending, self.states.reached(seq, end, self.page_size, hashes))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """A parallel sample shares every page of its parent and takes a copy of its state (made before the
        next step)."""
        self.bm.fork(parent, child)
        if self.states is not None:
            add_copy(self._pending, self.states.fork(parent, child))

    # ---- leaving --------------------------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """seq gives back its pages and state slots (preempted or recomputed); its page hashes stay: its tokens
        are the same when it is admitted again."""
        self.bm.free_sequence(seq)
        if self.states is not None:
            self.states.free(seq)

    def finish(self, seq: Sequence) -> None:
        """seq is done: everything it holds goes back and nothing of it is kept."""
        self.bm.finish(seq)
        if self.states is not None:
            self.states.free(seq)

    def abort(
        self, running: Iterable[Sequence], swapped: Iterable[Sequence], waiting: Iterable[Sequence]
    ) -> None:
        """Every request is dropped: running ones give back pages and slots, swapped ones their CPU pages and
        slots, waiting ones what is kept of them; state copies not made yet are dropped with their snapshots."""
        for seq in running:
            self.finish(seq)
        for seq in swapped:
            self.bm.free_cpu_pages(seq)
            if self.states is not None:
                self.states.free_cpu(seq)
        for seq in waiting:
            self.bm.forget(seq)
        if self.states is not None:
            self.states.abort()
        self._pending.clear()

    # ---- swapping -------------------------------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        """The CPU pool has room for seq's pages and, for a hybrid, a CPU state slot."""
        return self.bm.can_swap_out(seq) and (self.states is None or self.states.num_free_cpu > 0)

    def swap_out(self, seq: Sequence) -> tuple[list[PageCopy], StateCopy | None]:
        """seq's pages and state to the CPU; returns the copies to make before anything freed here is reused."""
        pages = self.bm.swap_out(seq)
        return pages, self.states.swap_out(seq) if self.states is not None else None

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Free pages for seq's pages and its next tokens, and free state slots for it."""
        if self.bm.num_pages_to_swap_in(seq, num_new_tokens) > self.bm.num_free_pages:
            return False
        return self.states is None or self.states.seats(seq) <= self.states.num_free

    def swap_in(self, seq: Sequence) -> tuple[list[PageCopy], StateCopy | None]:
        """seq's pages and state back from the CPU; returns the copies."""
        pages = self.bm.swap_in(seq)
        return pages, self.states.swap_in(seq) if self.states is not None else None

    # ---- checks ----------------------------------------------------------------------------------------------
    def check_integrity(self, running: Iterable[Sequence], swapped: Iterable[Sequence]) -> None:
        """Both kinds' bookkeeping agrees with the live sequences: every page and every state slot free or held
        by exactly the sequences that should hold it (AssertionError otherwise)."""
        running, swapped = list(running), list(swapped)
        self.bm.check_integrity(running + swapped)
        if self.states is not None:
            self.states.check(running, swapped)
