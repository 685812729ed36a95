"""The running sequences as columns while each of them only decodes: the scheduler's steady state.

A step of decodes at 256 sequences spent most of its bookkeeping passing over sequences one by one: in the
scheduler's loop (the tests of `decodes_generated_token`, the block manager's record, a `ScheduledSequence` made)
and again in the output processor's pass (bench/RESULTS.md, "2026-12-06 (03:00)" and "(06:10)"). Once a step has planned every running sequence
as a plain decode (scheduler.py's fast path: no page held twice, no window, no encoder budget, no state unit, no
LoRA adapter), the next step's plan is known but for the few sequences that cross into a new page: each decodes
the token it generated, one position on. This holds those sequences as columns (their starts, the tokens their
pages hold, their length limits) and plans a step over them in a few numpy operations; the plan carries them as
a `DecodeColumns` (scheduler_output.py), which the runner and the output processor read as columns too.

It stays true while the running set is the one it was made from and each step it plans runs: the scheduler
drops it when a sequence enters or leaves `running` (admitted, swapped in, forked, finished, preempted,
recomputed, aborted), and falls back to its loop, dropping it, when a step cannot be planned this way (too few
free pages for the sequences crossing into a page: the loop preempts; a token budget under the batch).
`check` holds it against the sequences and the block manager (Engine.check_integrity).

The output processor's plain pass would still touch every sequence every step, after a forward that has streamed
the KV cache through the processor's caches, where each distinct object touched costs a miss to memory
(bench/micro/cold_objects.py; its figures in bench/RESULTS.md, "2026-12-06 (06:10)"). So the
tokens it samples are held here too, a row a step (`generated`), and written into a sequence only when something
reads or writes its tokens or computed count (Sequence's properties call `write_back` or `release`), when the
columns are dropped, or every PENDING_ROWS steps. The properties cost every other reader a Python call per
access (measured in the same section).
"""

from __future__ import annotations

import numpy as np

from .block_manager import BlockManager
from .kv_coordinator import KVCacheCoordinator
from .prefix_cache import PrefixCache
from .scheduler_output import DecodeColumns, ScheduledSequence, SchedulerOutput

PENDING_ROWS = 64  # steps of tokens held before they are written into the sequences at once
# the fewest running sequences the columns are made for: below, the loop's passes cost less than the arrays'
# operations, whose cost is fixed whatever their length (bench/RESULTS.md, "2026-12-06 (06:10)")
MIN_SEQS = 16


class SteadyDecodes:
    def __init__(self, scheduled: list[ScheduledSequence], bm: BlockManager):
        """From a step just planned whose every sequence decodes a generated token (each plain: no window, no
        page held twice, no state unit); the columns then describe the step after it."""
        self.seqs = [s.seq for s in scheduled]
        self.req_ids = [s.req_id for s in scheduled]
        self.starts = np.array([s.start + 1 for s in scheduled], dtype=np.int64)
        self.rooms = np.array([self._room(bm, i) for i in self.req_ids], dtype=np.int64)
        self.limits = np.array([seq.reserved_tokens for seq in self.seqs], dtype=np.int64)
        self.stops_at_eos = np.array([not seq.params.ignore_eos for seq in self.seqs], dtype=bool)
        # the tokens the steps planned here generated, row k the k-th step's, not yet written into the sequences
        # (`generated`); each sequence's rows written in so far, and the computed counts they come with
        self.pending = np.zeros((PENDING_ROWS, len(self.seqs)), dtype=np.int64)
        self.num_pending = 0
        self.written = np.zeros(len(self.seqs), dtype=np.int64)
        self.computed = self.starts
        self.place = {seq: i for i, seq in enumerate(self.seqs)}
        self.holding = False  # whether the sequences' `_pending` is this

    @staticmethod
    def _room(bm: BlockManager, req_id: int) -> int:
        """The tokens a sequence's pages hold: its shortest table's pages, full."""
        return bm.page_size * min(map(len, bm.sequences[req_id].tables))

    def __len__(self) -> int:
        return len(self.seqs)

    def plan(self, kv: KVCacheCoordinator, out: SchedulerOutput, budget: int) -> int | None:
        """The next step's decodes into `out` (each sequence's token at its start, a new page in each group for
        those crossing into one): the budget left; None, nothing taken, when the budget is under the batch, too
        few pages are free for those crossing, or a page is held twice (the scheduler's loop then plans)."""
        bm, starts = kv.bm, self.starts
        P = bm.page_size
        crossing = np.flatnonzero(starts == self.rooms).tolist()
        if len(self) > budget or bm.pool.num_shared or len(crossing) * bm.num_groups > bm.num_free_pages:
            return None
        records, req_ids, news = bm.sequences, self.req_ids, {}
        # pages the step fills, registered where the prefix cache is on: both in the loop's order, sequence by
        # sequence (a page taken from the free pool may be a cached one whose hash a later registration reuses)
        filling = np.flatnonzero((starts + 1) % P == 0).tolist() if kv.prefix_cache.enabled else []
        for i in sorted(crossing + filling) if filling else crossing:
            record = records[req_ids[i]]
            if starts[i] == self.rooms[i]:  # its token begins a page (a page's last token cannot)
                news[i] = bm.append_pages(record, int(starts[i]) // P + 1)
            elif (int(starts[i]) + 1) // P > record.num_registered:
                kv.prefix_cache.register_full_pages(self.seqs[i], int(starts[i]) + 1)
        if crossing:
            self.rooms[crossing] += P
        self.starts = starts + 1  # the step after: each has one more token computed, one more generated
        out.decodes = DecodeColumns(self.seqs, req_ids, starts, self.limits, self.stops_at_eos, self, news)
        out.num_generating, out.tables_changed = len(self), bool(news)
        return budget - len(self)

    # ---- the tokens generated: held here as columns, written into the sequences when read ----------------------
    def generated(self, tokens: np.ndarray) -> None:
        """The step this planned last ran and sampled `tokens` (one a sequence, in order): each sequence has one
        more token and one more computed, held here (the output processor's plain pass), not written into it."""
        if self.num_pending == len(self.pending):
            self.release()  # the rows are full: written in, and held again from the next
        if not self.holding:
            for seq in self.seqs:
                seq._pending = self
            self.holding = True
        self.pending[self.num_pending] = tokens
        self.num_pending += 1
        self.computed = self.starts  # plan() moved them on when it planned the step

    def write_back(self, seq) -> None:
        """Write what is held for `seq` into it (a reader asks for its tokens or its computed count)."""
        i = self.place[seq]
        k = int(self.written[i])
        if k < self.num_pending:
            seq._output_token_ids += self.pending[k : self.num_pending, i].tolist()
            self.written[i] = self.num_pending
        seq._num_computed_tokens = int(self.computed[i])

    def release(self) -> None:
        """Write everything held into the sequences and hold nothing more (the scheduler drops the columns, a
        writer changes a sequence, the rows are full)."""
        if not self.holding:
            return
        self.holding = False
        for seq in self.seqs:
            if seq._pending is self:
                seq._pending = None
                self.write_back(seq)
        self.num_pending = 0
        self.written[:] = 0

    def check(self, running, bm: BlockManager, prefix_cache: PrefixCache) -> None:
        """The columns hold what the sequences and their pages say (AssertionError otherwise): each sequence
        decodes its last generated token next, its pages hold what the columns say, the runner has its tables,
        and every page its computed tokens fill is registered (`plan` registers a page as it fills)."""
        assert self.seqs == list(running), "the running set changed under the steady columns"
        for seq, start, room, limit in zip(self.seqs, self.starts.tolist(), self.rooms.tolist(), self.limits):
            assert seq.num_computed_tokens == start == seq.num_tokens - 1 >= seq.num_prompt_tokens, seq.seq_id
            assert room == self._room(bm, seq.seq_id) and limit == seq.reserved_tokens, seq.seq_id
            record = bm.sequences[seq.seq_id]
            assert record.unsent is None, seq.seq_id
            assert not prefix_cache.enabled or record.num_registered == start // bm.page_size, seq.seq_id
