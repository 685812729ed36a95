"""The KV cache coordinator: one owner of what a sequence holds in the cache (vLLM v1's `KVCacheCoordinator`).

A sequence holds pages in every KV cache group (block_manager.py, with the prefix cache and the CPU swap pages)
and whatever else the model keeps per sequence, each held by its manager behind one protocol (`CacheManager`:
a hybrid's state slots, state_slots.py). Each of the scheduler's actions (admit, grow, finish, drop for
recompute, swap out, swap in, fork, abort) must reach every manager at once, in an order that keeps them
consistent: a prefix is usable only where every manager has it, a sequence swaps out only where every manager
has CPU room. This module is where that is written once, as one loop over the managers, so the scheduler and
the engine call one method per action and never hold two managers side by side. A model with pages alone has
no manager beside the block manager.

Pure integers like its managers: the copies a manager returns are filed into its share of the plan being made
(cache_spec.UnitCopies, `SchedulerOutput.unit_copies`); the engine applies them to that manager's tensors.
"""

from __future__ import annotations

from collections.abc import Iterable

from batchrun.engine.core.block_manager import BlockManager
from batchrun.engine.core.cache_spec import PageCopy, UnitCopies, UnitCopy, Usage, UsageColumns
from batchrun.engine.core.prefix_cache import PrefixMatch
from batchrun.engine.core.sequence import Sequence


class CacheManager:
    """What a sequence holds beside its pages, in pure integers: which units (state slots) each sequence holds.
    The coordinator calls every manager in each action, after the block manager; a copy returned (None:
    nothing to copy) is filed into the plan that makes it (`device`, `swap_out`, `swap_in` of the manager's
    `UnitCopies`). The defaults are a manager that keeps nothing per prefix and never cuts a step.

    Its usage is a typed record: the class names its statistics' columns once (`usage_columns`), `usage` counts
    them, and the memory snapshot (memory.py), the statistics (stats.py) and the report derive all they show of
    the manager from those two and `bytes_per_unit`."""

    usage_columns: UsageColumns  # what the statistics show of it (0 for a model without it)
    bytes_per_unit = 0  # one unit's bytes, for the run's summary (`usage_columns.bytes_per_unit`)
    # seq_id -> the full pages (a count) where its next step must stop (a prefix whose content the manager
    # keeps); the scheduler asks it of every running sequence, every step. None: this manager never cuts a step
    step_ends: dict[int, int] | None = None

    def new_step(self) -> None:
        """A plan begins."""

    # ---- admission
    def admission_error(self, num_samples: int) -> str | None:
        """Why a request of `num_samples` parallel samples can never run with this manager's units, or None."""
        return None

    def usable(self, hashes: list[bytes], k: int) -> bool:
        """A cached prefix of k pages is usable: this manager holds what a sequence needs at its end."""
        return True

    def admission_waits(self, hashes: list[bytes], matched: int) -> bool:
        """A longer prefix of these pages than `matched` is being kept this step: admission waits one step."""
        return False

    def can_admit(self, seq) -> bool:
        """Free units for seq (and for the samples it will fork)."""
        return True

    def keep_prefix(self, seq, hashes: list[bytes], matched: int, page_hashes, waiting) -> None:
        """Choose the prefix of seq worth keeping (`page_hashes(o)` of each of the next `waiting` prompts)."""

    def admit(self, seq, hashes: list[bytes], matched: int) -> UnitCopy | None:
        """seq's units; returns the copy of what is kept at its cached prefix's end into them (this plan)."""
        return None

    # ---- running
    def limit(self, seq, start: int, n: int, page_size: int) -> int:
        """n, or fewer: where seq's step must stop (`step_ends`)."""
        return n

    def planned(self, seq, end: int, page_size: int, page_hashes) -> UnitCopy | None:
        """seq is planned up to `end` tokens; returns a copy the next plan makes (after this step computed its
        source). Asked only for a sequence listed in the cutting manager's `step_ends`."""
        return None

    def fork(self, parent, child) -> UnitCopy | None:
        """A parallel sample: the copy of its parent's units into its own (the next plan's)."""
        return None

    def unit_of(self, seq) -> int:
        """The unit a running sequence's step reads (-1: none): its place in ScheduledSequence.units."""
        return -1

    # ---- leaving
    def free(self, seq) -> None:
        """seq gives back its accelerator units (finished, preempted, recomputed)."""

    def free_cpu(self, seq) -> None:
        """A swapped sequence gives back its CPU units (aborted)."""

    def abort(self) -> None:
        """Every request is dropped: nothing pending stays."""

    # ---- swapping
    def can_swap_out(self, seq) -> bool:
        return True

    def swap_out(self, seq) -> UnitCopy | None:
        return None

    def can_swap_in(self, seq) -> bool:
        return True

    def swap_in(self, seq) -> UnitCopy | None:
        return None

    # ---- checks and usage
    def check(self, running: list, swapped: list) -> None:
        """Every unit free or held by exactly the sequences that should hold it (AssertionError otherwise)."""

    def usage(self, running, recount: bool = False) -> Usage:
        """The units there are and those the running sequences hold (`usage_columns`), counted by the manager,
        or (`recount`) sequence by sequence to prove the first."""
        return Usage(0, 0)


def _no_units(seq: Sequence) -> tuple[()]:
    return ()


def _add(copies: list[UnitCopy], copy: UnitCopy | None) -> None:
    if copy is not None:
        copies.append(copy)


def _units_of(managers):
    """seq -> each manager's unit of seq, as a tuple in their order: one call a sequence, no loop for one manager."""
    if not managers:
        return _no_units
    if len(managers) == 1:
        unit_of = managers[0].unit_of
        return lambda seq: (unit_of(seq),)
    units = [m.unit_of for m in managers]
    return lambda seq: tuple([u(seq) for u in units])


class KVCacheCoordinator:
    """Pages (`bm`) and every other manager's units (`managers`: each a CacheManager, in the engine's order of
    their tensors; none for a model with pages alone) held as one resource per sequence.

    A manager's copies that must wait for the step that computes their source (a fork's, a kept prefix's) are kept
    here until the next plan takes them (`new_step`)."""

    def __init__(self, block_manager: BlockManager, *managers: CacheManager):
        self.bm = block_manager
        self.managers = managers
        self.prefix_cache = block_manager.prefix_cache
        self.page_size = block_manager.page_size
        # asked of every scheduled sequence, every step: the managers' own methods and dict, not calls through
        # this object. units_of: each manager's unit a sequence's step reads (ScheduledSequence.units);
        # snapshot_ends: seq_id -> the prefix (full pages) where its step must stop, the chunk rule's last cut
        # (the one manager that cuts steps changes that dict in place; none: empty)
        cutting = [m for m in managers if m.step_ends is not None]
        assert len(cutting) <= 1, "one manager at most cuts a sequence's steps (CacheManager.step_ends)"
        self._cutting = cutting
        self.snapshot_ends: dict[int, int] = cutting[0].step_ends if cutting else {}
        self.units_of = _units_of(managers)
        self.block_tables = block_manager.block_tables
        self.take_new_block_ids = block_manager.take_new_block_ids  # the runner's tables' news (the plan's)
        # per manager: copies since the last plan (made first in the next), and the plan being made's copies
        self._pending: list[list[UnitCopy]] = [[] for _ in managers]
        self._plan = [UnitCopies() for _ in managers]
        usable = [m.usable for m in managers if type(m).usable is not CacheManager.usable]
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

    @property
    def num_used_pages(self) -> int:
        return self.bm.num_used_pages

    def pages_to_run(self, num_prompt_tokens: int, num_tokens: int, max_chunk: int) -> int:
        """The most pages one sequence holds at once over its life, in every KV cache group (PageLayout)."""
        return self.bm.layout.pages_to_run(num_prompt_tokens, num_tokens, max_chunk)

    def usage(self, running, recount: bool = False) -> dict[str, int]:
        """Each manager's usage columns by name (a memory snapshot's `usage`); `recount`: each manager counts
        sequence by sequence."""
        row = {}
        for manager in self.managers:
            columns = manager.usage_columns
            row[columns.total], row[columns.used] = manager.usage(running, recount)
        return row

    def unit_bytes(self) -> dict[str, int]:
        """Each manager's bytes per unit for the run's summary, by its key (a hybrid's bytes_per_state_slot)."""
        return {m.usage_columns.bytes_per_unit: m.bytes_per_unit for m in self.managers}

    def admission_error(self, num_samples: int) -> str | None:
        """Why a request of `num_samples` parallel samples can never run with some manager's units, or None."""
        return next((e for e in (m.admission_error(num_samples) for m in self.managers) if e), None)

    # ---- a step ---------------------------------------------------------------------------------------------
    def new_step(self) -> list[UnitCopies]:
        """A plan begins: returns each manager's share of its copies, which starts with those the last plan left
        (forks, kept prefixes) and which this coordinator fills as the plan is made."""
        self._plan = [UnitCopies(pending) for pending in self._pending]
        self._pending = [[] for _ in self.managers]
        for manager in self.managers:
            manager.new_step()
        return self._plan

    # ---- admission ------------------------------------------------------------------------------------------
    def match(self, seq: Sequence) -> PrefixMatch:
        """The longest cached prefix of seq that every manager holds: pages in every group and, for a hybrid, the
        state at its end (a snapshot)."""
        return self.prefix_cache.match(seq, self._usable)

    def can_admit(self, seq: Sequence, match: PrefixMatch, max_chunk: int | None, reserve: int) -> bool:
        """Whether seq may be admitted behind `match` now: the pages its prompt takes (steps of at most
        `max_chunk` tokens) beside `reserve` free pages, every manager's units, and no longer prefix of it being
        kept this step (it waits one step for that rather than compute it twice)."""
        managers = self.managers
        if any(m.admission_waits(match.prompt_hashes, match.num_blocks) for m in managers):
            return False
        need = self.bm.num_new_pages_for_admission(seq, match, max_chunk)
        if need + reserve > self.bm.num_free_pages:
            return False
        return all(m.can_admit(seq) for m in managers)

    def keep_prefix_state(self, seq: Sequence, match: PrefixMatch, waiting: Iterable[Sequence]) -> None:
        """A manager keeping prefixes (a hybrid's states): the prefix of seq worth keeping, from the next `waiting`
        prompts."""
        for manager in self.managers:
            manager.keep_prefix(
                seq, match.prompt_hashes, match.num_blocks, self.prefix_cache.page_hashes, waiting
            )

    def admit(self, seq: Sequence, max_new_tokens: int, match: PrefixMatch) -> int:
        """Give seq its cached prefix pages, pages for its next `max_new_tokens` tokens at most and every manager's
        units (with, behind a kept prefix, the copy of what is kept into them, in this plan). Returns how many
        tokens it computes."""
        n = self.bm.allocate_sequence(seq, max_new_tokens, match)
        for manager, copies in zip(self.managers, self._plan):
            _add(copies.device, manager.admit(seq, match.hashes, match.num_blocks))
        return n

    # ---- running --------------------------------------------------------------------------------------------
    def limit(self, seq: Sequence, start: int, n: int) -> int:
        """n, or fewer: a step stops where a manager keeps a prefix (a hybrid's state)."""
        for manager in self._cutting:
            n = manager.limit(seq, start, n, self.page_size)
        return n

    def planned(self, seq: Sequence, end: int) -> None:
        """seq is planned up to `end` tokens: its full pages go into the prefix cache and, at a prefix a manager
        keeps, the copy that keeps it waits for the next plan. The managers are asked only for a sequence the
        cutting manager lists (`snapshot_ends`; the decodes the scheduler plans over its columns skip the others): one keeps a
        prefix only where a step was cut to end there."""
        self.prefix_cache.register_full_pages(seq, end)
        if seq.seq_id in self.snapshot_ends:
            for manager, pending in zip(self.managers, self._pending):
                _add(pending, manager.planned(seq, end, self.page_size, self.prefix_cache.page_hashes))

    def grow(self, seq: Sequence, num_new_tokens: int) -> list[PageCopy]:
        """Make the slots of seq's next `num_new_tokens` tokens writable; returns the copies on write."""
        return self.bm.grow(seq, num_new_tokens)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """A parallel sample shares every page of its parent and takes a copy of every manager's units (made before
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
        """The CPU pools have room for seq's pages and every manager's units."""
        return self.bm.can_swap_out(seq) and all(m.can_swap_out(seq) for m in self.managers)

    def swap_out(self, seq: Sequence) -> list[PageCopy]:
        """seq's pages and units to the CPU; returns the page copies to make before anything freed here is
        reused (the managers' go into the plan's `unit_copies`)."""
        pages = self.bm.swap_out(seq)
        for manager, copies in zip(self.managers, self._plan):
            _add(copies.swap_out, manager.swap_out(seq))
        return pages

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Free pages for seq's pages and its next tokens, and free units of every manager for it."""
        if self.bm.num_pages_to_swap_in(seq, num_new_tokens) > self.bm.num_free_pages:
            return False
        return all(m.can_swap_in(seq) for m in self.managers)

    def swap_in(self, seq: Sequence) -> list[PageCopy]:
        """seq's pages and units back from the CPU; returns the page copies."""
        pages = self.bm.swap_in(seq)
        for manager, copies in zip(self.managers, self._plan):
            _add(copies.swap_in, manager.swap_in(seq))
        return pages

    # ---- checks ----------------------------------------------------------------------------------------------
    def check_integrity(self, running: Iterable[Sequence], swapped: Iterable[Sequence]) -> None:
        """Every manager's bookkeeping agrees with the live sequences: every page and every unit free or held by
        exactly the sequences that should hold it (AssertionError otherwise)."""
        running, swapped = list(running), list(swapped)
        self.bm.check_integrity(running + swapped)
        for manager in self.managers:
            manager.check(running, swapped)
