"""The runner's block tables: one persistent row per request of the input batch (input_batch.py), per KV cache
group, written only with what the scheduler's plan says changed.

The block manager keeps each sequence's tables as Python lists (block_manager.py: pure integers, checked by
`check_integrity`) and hands on, once, the entries the runner has not seen (`ScheduledSequence.new_block_ids`:
a whole table for a request admitted, swapped in or forked, one page for a decode crossing into a new page, the
page a copy on write replaced). Here those entries go into the request's row, every entry of a step in one
indexed write per group, and each row's length is kept beside it. A decode whose tables did not change is not
looked at: turning every table into a tensor every step would cost host time that grows with the batch and the
context. A page given back behind a sliding window keeps its old number in the row: no backend reads a key
behind the window, so the number is never used.

A step's tables are then one index of those tensors by the step's rows (or a view of them, where the rows are in
order), and its slots' pages one gather of them by each new token's page: no Python loop over tokens, and none
over pages of a table that did not change.
"""

from __future__ import annotations

import numpy as np
import torch

from batchrun.engine.attention import int_tensor
from batchrun.engine.core.sequence import NULL_PAGE


class BlockTableBuffer:
    def __init__(self, num_groups: int, capacity: int, pin: bool = False):
        self.num_groups = num_groups
        # a CUDA runner's: its tables are copied to the device asynchronously from pinned memory
        self.pin = pin
        self.tables = [self._empty(capacity, 16) for _ in range(num_groups)]  # [rows, width] int32 each
        self.num_blocks = np.zeros((num_groups, capacity), dtype=np.int64)  # each row's tables' lengths
        # the last step's rows and tables, until a write: a step of the same rows whose tables did not change
        # (most decode steps) takes them as they are, with no pass over the rows' lengths and no new views
        self._last: tuple[np.ndarray, list[torch.Tensor]] | None = None

    def _empty(self, rows: int, width: int) -> torch.Tensor:
        return torch.zeros(rows, width, dtype=torch.int32, pin_memory=self.pin)

    def grow_rows(self, capacity: int) -> None:
        """Room for `capacity` rows (the input batch's rows doubled)."""
        old = self.tables[0].shape[0]
        self._last = None
        self.tables = [torch.cat([t, self._empty(capacity - old, t.shape[1])]) for t in self.tables]
        grown = np.zeros((self.num_groups, capacity), dtype=np.int64)
        grown[:, :old] = self.num_blocks
        self.num_blocks = grown

    def write(self, rows: list[int], new_block_ids: list) -> None:
        """The step's changes into its rows: `new_block_ids[i]` (ScheduledSequence.new_block_ids) for row
        `rows[i]`, per group (the first entry changed, the entries from there) or None (unchanged, the common
        decode). Each row's table ends where its last written entry does."""
        self._last = None
        at = [([], [], []) for _ in range(self.num_groups)]  # per group: rows, columns, pages
        for row, new in zip(rows, new_block_ids):  # every step, for every sequence: kept lean
            if new is None:
                continue
            for g, (column, pages) in enumerate(new):
                end = column + len(pages)
                self.num_blocks[g, row] = end
                if pages:
                    a = at[g]
                    a[0].extend([row] * len(pages)), a[1].extend(range(column, end)), a[2].extend(pages)
        for g, (at_rows, columns, pages) in enumerate(at):
            if at_rows:
                self._fit(g, max(columns) + 1)
                self.tables[g][int_tensor(at_rows), int_tensor(columns)] = int_tensor(pages, torch.int32)

    def step_tables(self, rows) -> list[torch.Tensor]:
        """Per group, the step's tables [S, W] int32 (W: the longest of the step's tables, at least 1); `rows`:
        the step's rows (a numpy array or a list)."""
        rows = np.asarray(rows, dtype=np.int64)
        last = self._last
        if last is not None and len(last[0]) == len(rows) and (last[0] == rows).all():
            return last[1]
        tables = self._step_tables(rows)
        self._last = (rows, tables)
        return tables

    def _step_tables(self, rows: np.ndarray) -> list[torch.Tensor]:
        widths = self.num_blocks[:, rows].max(axis=1, initial=1).tolist()
        first = int(rows[0]) if len(rows) else 0
        if not self.pin and (np.diff(rows) == 1).all():
            # rows in order (requests admitted together keep theirs): the step's tables are views of the buffers,
            # which nothing writes before the step has run (a pinned buffer is copied to a GPU asynchronously,
            # and the next step's writes could overtake the copy: there the rows are always gathered)
            return [t[first : first + len(rows), :w] for t, w in zip(self.tables, widths)]
        index = torch.from_numpy(rows)
        return [t[:, :w].index_select(0, index) for t, w in zip(self.tables, widths)]

    def pages(self, group: int, rows: np.ndarray, page_index: np.ndarray) -> np.ndarray:
        """[T] int32: the page of each new token's cache slot in `group`, from each token's row and the index of
        its page in that row's table (position // page_size): one gather, no Python loop over tokens."""
        return self.tables[group].numpy()[rows, page_index]

    def _fit(self, group: int, width: int) -> None:
        """The group's buffer at least `width` entries wide (twice as wide as before when it grows)."""
        buf = self.tables[group]
        if width > buf.shape[1]:
            self._last = None
            wider = self._empty(buf.shape[0], max(width, 2 * buf.shape[1]))
            wider[:, : buf.shape[1]] = buf
            self.tables[group] = wider

    def check(self, row: int, tables: list[list[int]], unsent: list[int] | None) -> None:
        """Row `row` holds `tables` (the block manager's), up to the entries not handed on yet (`unsent`, per
        group; None: all handed on), entries given back behind a window aside (AssertionError otherwise)."""
        for g, table in enumerate(tables):
            n = len(table) if unsent is None else unsent[g]
            if unsent is None:
                assert self.num_blocks[g, row] == n, (row, g, int(self.num_blocks[g, row]), n)
            got = self.tables[g][row, :n].tolist() if n <= self.tables[g].shape[1] else []
            assert len(got) == n, (row, g, "row narrower than its table")
            for b, (want, have) in enumerate(zip(table, got)):
                assert want == have or want == NULL_PAGE, (row, g, b, want, have)
