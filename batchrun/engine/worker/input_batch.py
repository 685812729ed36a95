"""The model runner's own copy of what each running request's step is built from (after vLLM v1's `InputBatch`).

The runner used to read every step's token ids, prompt lengths, positions and block tables from the live
`Sequence`s and block manager lists the scheduler handed it. Here it keeps them itself, one row per request, in
persistent arrays: a row is written once when the request is new to the runner (scheduler_output.NewRequest, from the
scheduler's output: its prompt and what it generated so far, how many of those its cached prefix computed, its
adapter, its images), a forked sample's row is copied from its parent's, the tokens the engine
samples are appended to their rows after each step, all of a step's in one indexed write (no per-token Python
loop), and each row's computed count moves on with each step it runs. Its block tables are rows of
block_table_buffer.py, written with the entries the plan says changed. A step's input ids are then one gather of
these rows (a decode step) or a slice per row (a step that prefills), its positions start at the rows' computed
counts.

A preempted request keeps its row (its tokens do not change while it waits: swap-in and recompute find them
there); a finished or aborted request's row goes back.
"""

from __future__ import annotations

import heapq

import numpy as np

from batchrun.engine.core.scheduler_output import NewRequest
from batchrun.engine.worker.block_table_buffer import BlockTableBuffer


class InputBatch:
    def __init__(self, capacity: int, width: int = 64, num_groups: int = 1, pin: bool = False):
        """`num_groups`: the KV cache groups (a block table each); `pin`: the tables in pinned memory (CUDA)."""
        self.token_ids = np.zeros((capacity, width), dtype=np.int64)  # [rows, width]
        self.num_tokens = np.zeros(capacity, dtype=np.int64)  # each row's tokens so far
        self.num_computed = np.zeros(capacity, dtype=np.int64)  # each row's tokens in the cache
        self.block_tables = BlockTableBuffer(num_groups, capacity, pin)
        self.num_prompt_tokens = [0] * capacity
        self.adapters: list[int | None] = [None] * capacity
        self.images: list = [None] * capacity  # each row's ImageInputs (None: none)
        self.row_of: dict[int, int] = {}  # req_id -> its row
        # the free rows as a heap, lowest first: requests admitted together then take rows in order, whatever
        # order the rows came back in, and a step's tables stay views of the buffers (block_table_buffer.py)
        self._free = list(range(capacity))
        # the last step's request ids and their rows (`rows`): a decode step's sampled tokens go onto the very
        # rows it ran, and the next step most often runs the same requests in the same order, so both reuse
        # them instead of looking every id up again (a row never moves while its request holds it: forks take
        # new rows; a row given back forgets them, as another request may take it)
        self._step_ids: list[int] = []
        self._step_rows = np.zeros(0, dtype=np.int64)

    # ---- rows in and out ------------------------------------------------------------------------------------
    def add(self, requests: list[NewRequest]) -> None:
        """Rows for `requests` (a request already holding one, a recompute readmitted, has it rewritten)."""
        for r in requests:
            row = self.row_of.get(r.req_id)
            if row is None:
                row = self.row_of[r.req_id] = self._take_row()
            n = len(r.token_ids)
            self._fit(n)
            self.token_ids[row, :n] = r.token_ids
            self.num_tokens[row] = n
            self.num_computed[row] = r.num_computed_tokens
            self.num_prompt_tokens[row] = r.num_prompt_tokens
            self.adapters[row] = r.adapter
            self.images[row] = r.images

    def fork(self, parent: int, child: int) -> None:
        """A parallel sample's row: a copy of its parent's (taken before the parent's next token)."""
        src = self.row_of[parent]
        row = self.row_of[child] = self._take_row()
        self.token_ids[row] = self.token_ids[src]
        self.num_tokens[row] = self.num_tokens[src]
        self.num_computed[row] = self.num_computed[src]
        self.num_prompt_tokens[row] = self.num_prompt_tokens[src]
        self.adapters[row] = self.adapters[src]
        self.images[row] = self.images[src]

    def remove(self, req_ids) -> None:
        if req_ids:  # a row given back may be taken by another request: the step's rows are not reused
            self._step_ids, self._step_rows = [], np.zeros(0, dtype=np.int64)
        for req_id in req_ids:
            row = self.row_of.pop(req_id, None)
            if row is not None:
                heapq.heappush(self._free, row)

    def clear(self) -> None:
        self.remove(list(self.row_of))

    def append(self, req_ids: list[int], tokens: list[int]) -> None:
        """The step's sampled tokens, one per request, onto the ends of their rows (one indexed write)."""
        if not req_ids:
            return
        rows = self.rows(req_ids, keep=False)
        ends = self.num_tokens[rows]
        self._fit(int(ends.max()) + 1)
        self.token_ids[rows, ends] = tokens
        self.num_tokens[rows] = ends + 1

    # ---- a step's inputs --------------------------------------------------------------------------------------
    def rows(self, req_ids: list[int], keep: bool = True) -> np.ndarray:
        """[S] int64: the requests' rows (the step's per-sequence values are gathered by them); `keep`: kept as
        the step's, for `append`."""
        if req_ids and req_ids == self._step_ids:  # the last step's requests in the same order (most decodes)
            return self._step_rows
        row_of = self.row_of
        rows = np.fromiter([row_of[i] for i in req_ids], dtype=np.int64, count=len(req_ids))
        if keep:  # a copy: the caller's list may change after
            self._step_ids, self._step_rows = list(req_ids), rows
        return rows

    def decode_ids(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """[S] int64: each row's token at its position (a decode step's input ids)."""
        return self.token_ids[rows, positions]

    def slice_ids(self, row: int, start: int, end: int) -> np.ndarray:
        return self.token_ids[row, start:end]

    def computed(self, rows: np.ndarray, ends: np.ndarray) -> None:
        """The step's rows have their tokens up to `ends` in the cache (it is about to run them)."""
        self.num_computed[rows] = ends

    def check(self, seqs, records: dict) -> None:
        """Each of `seqs` (live Sequences) that holds a row has its tokens, computed count and, where it holds
        pages, its block tables there (`records`: the block manager's SequencePages by seq_id; AssertionError
        otherwise)."""
        for seq in seqs:
            row = self.row_of.get(seq.seq_id)
            if row is None:
                continue
            n = int(self.num_tokens[row])
            assert self.token_ids[row, :n].tolist() == seq.token_ids, seq.seq_id
            assert self.num_computed[row] == seq.num_computed_tokens, seq.seq_id
            record = records[seq.seq_id]
            if any(record.tables):  # a swapped sequence's tables come back whole when it does
                self.block_tables.check(row, record.tables, record.unsent)
            assert self.adapters[row] == seq.adapter and self.num_prompt_tokens[row] == seq.num_prompt_tokens
            assert self.images[row] is seq.images, seq.seq_id

    # ---- growth -----------------------------------------------------------------------------------------------
    def _take_row(self) -> int:
        if not self._free:  # more live requests than rows: twice the rows
            old = self.token_ids.shape[0]
            self.token_ids = np.concatenate([self.token_ids, np.zeros_like(self.token_ids)])
            self.num_tokens = np.concatenate([self.num_tokens, np.zeros_like(self.num_tokens)])
            self.num_computed = np.concatenate([self.num_computed, np.zeros_like(self.num_computed)])
            self.block_tables.grow_rows(2 * old)
            self.num_prompt_tokens += [0] * old
            self.adapters += [None] * old
            self.images += [None] * old
            self._free = list(range(old, 2 * old))
        return heapq.heappop(self._free)

    def _fit(self, width: int) -> None:
        """At least `width` tokens a row (twice as wide as before when it grows)."""
        old = self.token_ids.shape[1]
        if width > old:
            wider = np.zeros((self.token_ids.shape[0], max(width, 2 * old)), dtype=np.int64)
            wider[:, :old] = self.token_ids
            self.token_ids = wider
