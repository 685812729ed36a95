"""The running sequences' block tables in persistent tensors, for the step's metadata.

The block manager keeps each sequence's tables as Python lists (block_manager.py: pure integers, checked by
`check_integrity`). Turning every table into a tensor every step costs host time that grows with the batch and
the context; instead each sequence holds a row of one tensor per KV cache group for as long as it runs, and a
row is written only where its table changed since the last step (a decode the scheduler says gained no page,
`ScheduledSequence.tables_unchanged`, is not even looked at): a new table (admission, swap-in, a fork), a
page appended, or the last page replaced (copy-on-write of a shared page, which is always the page the next
token goes into). A page given back behind a sliding window keeps its old number in the row until the row is
next written: no backend reads a key behind the window, so the number is never used.

A table that only grew by a page (a decode crossing into a new page: the common change) has just that entry
written, every such entry of the step in one indexed write per group.

A step's tables are then one index of those tensors by the step's rows (or a view of them, where the rows are in
order), and its slots' pages one gather of them by each new token's page: no Python loop over tokens, and none
over pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import int_tensor


@dataclass
class _Row:
    row: int
    tables: list  # per group: the list object last written (identity: a new table is a new list)
    lengths: list[int]
    lasts: list[int]


class BlockTableBuffer:
    def __init__(self, num_groups: int, capacity: int, pin: bool = False):
        self.num_groups = num_groups
        self.pin = pin
        self.tables = [self._empty(capacity, 16) for _ in range(num_groups)]  # [rows, width] int32 each
        self._rows: dict[int, _Row] = {}  # seq_id -> its row
        self._free = list(range(capacity - 1, -1, -1))

    def _empty(self, rows: int, width: int) -> torch.Tensor:
        return torch.zeros(rows, width, dtype=torch.int32, pin_memory=self.pin)

    def step_tables(self, scheduled: list) -> list[torch.Tensor]:
        """Per group, the step's tables [S, W] int32 (W: the longest of the step's tables), each row brought up
        to date first from the scheduled sequences' tables (scheduler.ScheduledSequence.block_tables): a table
        that only grew by a page since the last step has that one entry written, all such entries of a group in
        one indexed write (the common change: a decode crossing into a new page); any other change rewrites the
        row."""
        rows, widths = [], [1] * self.num_groups
        appended = [([], [], []) for _ in range(self.num_groups)]  # per group: rows, columns, pages
        unchanged = []  # the entries of sequences whose tables did not change since they last ran
        for s in scheduled:  # every step, for every sequence: kept lean (bench/host.py)
            entry = self._rows.get(s.seq.seq_id)
            if entry is not None and s.tables_unchanged:
                unchanged.append(entry)
                rows.append(entry.row)
                continue
            if entry is None:
                entry = self._rows[s.seq.seq_id] = self._new_row(scheduled)
            for g, table in enumerate(s.block_tables):
                n, before = len(table), entry.lengths[g]
                if n > widths[g]:
                    widths[g] = n
                if (
                    table is entry.tables[g]
                    and n >= before
                    and (not before or table[before - 1] == entry.lasts[g])
                ):
                    if n == before:
                        continue  # unchanged: most decodes
                    if n == before + 1:  # one page appended
                        at = appended[g]
                        at[0].append(entry.row), at[1].append(before), at[2].append(table[-1])
                        entry.lengths[g], entry.lasts[g] = n, table[-1]
                        continue
                self._write(g, entry.row, table)
                entry.tables[g], entry.lengths[g], entry.lasts[g] = table, n, table[-1] if n else -1
            rows.append(entry.row)
        if unchanged:  # their rows are as written: only their lengths count towards the step's widths
            for g in range(self.num_groups):
                widths[g] = max(widths[g], max([e.lengths[g] for e in unchanged]))
        for g, (at_rows, columns, pages) in enumerate(appended):
            if at_rows:
                self._fit(g, widths[g])
                self.tables[g][int_tensor(at_rows), int_tensor(columns)] = int_tensor(pages, torch.int32)
        first = rows[0] if rows else 0
        if not self.pin and rows == list(range(first, first + len(rows))):
            # rows in order (sequences admitted together keep theirs): the step's tables are views of the buffers,
            # which nothing writes before the step has run (a pinned buffer is copied to a GPU asynchronously,
            # and the next step's writes could overtake the copy: there the rows are always gathered)
            return [t[first : first + len(rows), :w] for t, w in zip(self.tables, widths)]
        index = int_tensor(rows)
        return [t[:, :w].index_select(0, index) for t, w in zip(self.tables, widths)]

    def _fit(self, group: int, width: int) -> torch.Tensor:
        """The group's buffer, at least `width` entries wide (twice as wide as before when it grows)."""
        buf = self.tables[group]
        if width > buf.shape[1]:
            wider = self._empty(buf.shape[0], max(width, 2 * buf.shape[1]))
            wider[:, : buf.shape[1]] = buf
            buf = self.tables[group] = wider
        return buf

    def _write(self, group: int, row: int, table: list[int]) -> None:
        buf = self._fit(group, len(table))
        if table:
            buf[row, : len(table)] = int_tensor(table, torch.int32)

    def _new_row(self, scheduled: list) -> _Row:
        if not self._free:  # rows of sequences that no longer run (finished, preempted) go back
            live = {s.seq.seq_id for s in scheduled}
            for seq_id in [k for k in self._rows if k not in live]:
                self._free.append(self._rows.pop(seq_id).row)
        if not self._free:  # more sequences than rows: twice the rows
            old = self.tables[0].shape[0]
            self.tables = [torch.cat([t, self._empty(old, t.shape[1])]) for t in self.tables]
            self._free = list(range(2 * old - 1, old - 1, -1))
        G = self.num_groups
        return _Row(self._free.pop(), [None] * G, [0] * G, [-1] * G)

    def check(self, tables: dict[int, list[list[int]]]) -> None:
        """Each row of a sequence in `tables` (seq_id -> its block tables, for the running sequences) that has
        been through a step equals its tables, pages behind a window aside (AssertionError otherwise)."""
        for seq_id, seq_tables in tables.items():
            entry = self._rows.get(seq_id)
            if entry is None:
                continue  # admitted or forked since the last step: its row is written in the next
            for g, table in enumerate(seq_tables):
                row = self.tables[g][entry.row, : len(table)].tolist()
                for b, (want, got) in enumerate(zip(table, row)):
                    assert want == got or want == -1, (seq_id, g, b, want, got)


def slot_pages(tables: torch.Tensor, token_seq: torch.Tensor, page_index: torch.Tensor) -> torch.Tensor:
    """[T] int64: the page of each new token's cache slot, from the step's tables [S, W], each token's sequence
    [T] and the index of its page in its sequence's table [T] (position // page_size; host tensors)."""
    return tables[token_seq, page_index].long()
