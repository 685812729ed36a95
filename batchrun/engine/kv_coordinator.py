"""The KV cache coordinator: one owner of what a sequence holds in the cache, whatever the kind (vLLM v1's
`KVCacheCoordinator`).

A sequence holds pages in every KV cache group (block_manager.py, with the prefix cache and the CPU swap pages)
and whatever the model's other kinds keep per sequence (cache_kind.py: a hybrid's state slots, state_slots.py).
Each of the scheduler's actions (admit, grow, finish, drop for recompute, swap out, swap in, fork, abort) must
reach every kind at once, in an order that keeps them consistent: a prefix is usable only where every kind has
it, a sequence swaps out only where every kind has CPU room. This module is where that is written once, as one
loop over the kinds' managers, so the scheduler calls one method per action and never holds two managers side by
side. A model with pages alone has no kinds here.

Pure integers like its managers: the copies a kind's manager returns are filed into that kind's share of the
plan being made (cache_kind.KindCopies, `SchedulerOutput.kind_copies`); the engine applies them to the kind's
tensors.
"""

from __future__ import annotations

from collections.abc import Iterable

from .block_manager import BlockManager
from .cache_kind import KindCopies, KindCopy, KindManager
from .page_pool import PageCopy
from .prefix_cache import PrefixMatch
from .sequence import Sequence


def _no_units(seq: Sequence) -> tuple[()]:
    return ()


def _add(copies: list[KindCopy], copy: KindCopy | None) -> None:
    if copy is not None:
        copies.append(copy)


def _units_of(managers):
    """seq -> each manager's unit of seq, as a tuple in their order: one call a sequence, no loop for one kind."""
    if not managers:
        return _no_units
    if len(managers) == 1:
        unit_of = managers[0].unit_of
        return lambda seq: (unit_of(seq),)
    units = [m.unit_of for m in managers]
    return lambda seq: tuple([u(seq) for u in units])


class KVCacheCoordinator:
    """Pages (`bm`) and every other kind's units (`managers`: each kind's KindManager, in the engine's order of
    kinds; none for a model with pages alone) held as one resource per sequence.

    A kind's copies that must wait for the step that computes their source (a fork's, a kept prefix's) are kept
    here until the next plan takes them (`new_step`)."""

    def __init__(self, block_manager: BlockManager, *managers: KindManager):
        self.bm = block_manager
        self.managers = managers
        self.prefix_cache = block_manager.prefix_cache
        self.page_size = block_manager.page_size
        # asked of every scheduled sequence, every step: the managers' own methods and dict, not calls through
        # this object. units_of: each kind's unit a sequence's step reads (ScheduledSequence.units);
        # snapshot_ends: seq_id -> the prefix (full pages) where its step must stop, the chunk rule's last cut
        # (the one kind that cuts steps changes that dict in place; none: empty)
        cutting = [k for k in managers if k.step_ends is not None]
        assert len(cutting) <= 1, "one kind at most cuts a sequence's steps (KindManager.step_ends)"
        self._cutting = cutting
        self.snapshot_ends: dict[int, int] = cutting[0].step_ends if cutting else {}
        self.units_of = _units_of(managers)
        self.block_tables = block_manager.block_tables
        self.take_new_block_ids = block_manager.take_new_block_ids  # the runner's tables' news (the plan's)
        # per kind: copies since the last plan (made first in the next), and the plan being made's copies
        self._pending: list[list[KindCopy]] = [[] for _ in managers]
        self._plan = [KindCopies() for _ in managers]
        usable = [k.usable for k in managers if type(k).usable is not KindManager.usable]
        self._usable = (
            None
            if not usable
            else usable[0]
            if len(usable) == 1
            else lambda h, n: all(u(h, n) for u in usable)
        )

    # ---- what the scheduler and the engine read ------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.bm.num_pages

    def admission_error(self, num_samples: int) -> str | None:
        """Why a request of `num_samples` parallel samples can never run with some kind's units, or None."""
        return next((e for e in (k.admission_error(num_samples) for k in self.managers) if e), None)

    # ---- a step ---------------------------------------------------------------------------------------------
    def new_step(self) -> list[KindCopies]:
        """A plan begins: returns each kind's share of its copies, which starts with those the last plan left
        (forks, kept prefixes) and which this coordinator fills as the plan is made."""
        self._plan = [KindCopies(pending) for pending in self._pending]
        self._pending = [[] for _ in self.managers]
        for manager in self.managers:
            manager.new_step()
        return self._plan

    # ---- admission ------------------------------------------------------------------------------------------
    def match(self, seq: Sequence) -> PrefixMatch:
        """The longest cached prefix of seq that every kind holds: pages in every group and, for a hybrid, the
        state at its end (a snapshot)."""
        return self.prefix_cache.match(seq, self._usable)

    def can_admit(self, seq: Sequence, match: PrefixMatch, max_chunk: int | None, reserve: int) -> bool:
        """Whether seq may be admitted behind `match` now: the pages its prompt takes (steps of at most
        `max_chunk` tokens) beside `reserve` free pages, every kind's units, and no longer prefix of it being
        kept this step (it waits one step for that rather than compute it twice)."""
        managers = self.managers
        if any(k.admission_waits(match.prompt_hashes, match.num_blocks) for k in managers):
            return False
        need = self.bm.num_new_pages_for_admission(seq, match, max_chunk)
        if need + reserve > self.bm.num_free_pages:
            return False
        return all(k.can_admit(seq) for k in managers)

    def keep_prefix_state(self, seq: Sequence, match: PrefixMatch, waiting: Iterable[Sequence]) -> None:
        """A kind keeping prefixes (a hybrid's states): the prefix of seq worth keeping, from the next `waiting`
        prompts."""
        for manager in self.managers:
            manager.keep_prefix(
                seq, match.prompt_hashes, match.num_blocks, self.prefix_cache.page_hashes, waiting
            )

    def admit(self, seq: Sequence, max_new_tokens: int, match: PrefixMatch) -> int:
        """Give seq its cached prefix pages, pages for its next `max_new_tokens` tokens at most and every kind's
        units (with, behind a kept prefix, the copy of what is kept into them, in this plan). Returns how many
        tokens it computes."""
        n = self.bm.allocate_sequence(seq, max_new_tokens, match)
        for manager, copies in zip(self.managers, self._plan):
            _add(copies.device, manager.admit(seq, match.hashes, match.num_blocks))
        return n

    # ---- running --------------------------------------------------------------------------------------------
    def limit(self, seq: Sequence, start: int, n: int) -> int:
        """n, or fewer: a step stops where a kind keeps a prefix (a hybrid's state)."""
        for manager in self._cutting:
            n = manager.limit(seq, start, n, self.page_size)
        return n

    def planned(self, seq: Sequence, end: int) -> None:
        """seq is planned up to `end` tokens: its full pages go into the prefix cache and, at a prefix a kind
        keeps, the copy that keeps it waits for the next plan. The kinds are asked only for a sequence the
        cutting kind lists (`snapshot_ends`; the decodes the scheduler plans over its columns skip the others): a kind keeps a
        prefix only where a step was cut to end there."""
        self.prefix_cache.register_full_pages(seq, end)
        if seq.seq_id in self.snapshot_ends:
            for manager, pending in zip(self.managers, self._pending):
                _add(pending, manager.planned(seq, end, self.page_size, self.prefix_cache.page_hashes))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """A parallel sample shares every page of its parent and takes a copy of every kind's units (made before
        the next step)."""
        self.bm.fork(parent, child)
        for manager, pending in zip(self.managers, self._pending):
            _add(pending, manager.fork(parent, child))

    # ---- leaving --------------------------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """seq gives back its pages and units (preempted or recomputed); its page hashes stay: its tokens are
        the same when it is admitted again."""
        self.bm.free_sequence(seq)
        for manager in self.managers:
            manager.free(seq)

    def finish(self, seq: Sequence) -> None:
        """seq is done: everything it holds goes back and nothing of it is kept."""
        self.bm.finish(seq)
        for manager in self.managers:
            manager.free(seq)

    def abort(
        self, running: Iterable[Sequence], swapped: Iterable[Sequence], waiting: Iterable[Sequence]
    ) -> None:
        """Every request is dropped: running ones give back pages and units, swapped ones their CPU pages and
        units, waiting ones what is kept of them; copies not made yet are dropped with what they would keep."""
        for seq in running:
            self.finish(seq)
        for seq in swapped:
            self.bm.free_cpu_pages(seq)
            for manager in self.managers:
                manager.free_cpu(seq)
        for seq in waiting:
            self.bm.forget(seq)
        for manager, pending in zip(self.managers, self._pending):
            manager.abort()
            pending.clear()

    # ---- swapping -------------------------------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        """The CPU pools have room for seq's pages and every kind's units."""
        return self.bm.can_swap_out(seq) and all(k.can_swap_out(seq) for k in self.managers)

    def swap_out(self, seq: Sequence) -> list[PageCopy]:
        """seq's pages and units to the CPU; returns the page copies to make before anything freed here is
        reused (the kinds' go into the plan's `kind_copies`)."""
        pages = self.bm.swap_out(seq)
        for manager, copies in zip(self.managers, self._plan):
            _add(copies.swap_out, manager.swap_out(seq))
        return pages

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Free pages for seq's pages and its next tokens, and free units of every kind for it."""
        if self.bm.num_pages_to_swap_in(seq, num_new_tokens) > self.bm.num_free_pages:
            return False
        return all(k.can_swap_in(seq) for k in self.managers)

    def swap_in(self, seq: Sequence) -> list[PageCopy]:
        """seq's pages and units back from the CPU; returns the page copies."""
        pages = self.bm.swap_in(seq)
        for manager, copies in zip(self.managers, self._plan):
            _add(copies.swap_in, manager.swap_in(seq))
        return pages

    # ---- checks ----------------------------------------------------------------------------------------------
    def check_integrity(self, running: Iterable[Sequence], swapped: Iterable[Sequence]) -> None:
        """Every kind's bookkeeping agrees with the live sequences: every page and every unit free or held by
        exactly the sequences that should hold it (AssertionError otherwise)."""
        running, swapped = list(running), list(swapped)
        self.bm.check_integrity(running + swapped)
        for manager in self.managers:
            manager.check(running, swapped)
