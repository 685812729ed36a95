"""The running sequences' block tables in persistent tensors, for the step's metadata.

The block manager keeps each sequence's tables as Python lists (block_manager.py: pure integers, checked by
`check_integrity`). Turning every table into a tensor every step costs host time that grows with the batch and
the context; instead each sequence holds a row of one tensor per KV cache group for as long as it runs, and a
row is written only where its table changed since the last step: a new table (admission, swap-in, a fork), a
page appended, or the last page replaced (copy-on-write of a shared page, which is always the page the next
token goes into). A page given back behind a sliding window keeps its old number in the row until the row is
next written: no backend reads a key behind the window, so the number is never used.

A step's tables are then one index of those tensors by the step's rows, and its slot mapping one gather of
them by each new token's page: no Python loop over tokens, and none over pages.
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

    def step_tables(self, seqs: list) -> list[torch.Tensor]:
        """Per group, the step's tables [S, W] int32 (W: the longest of the step's tables), each row brought up
        to date first."""
        rows, widths = [], [1] * self.num_groups
        for seq in seqs:
            entry = self._rows.get(seq.seq_id)
            if entry is None:
                entry = self._rows[seq.seq_id] = self._new_row(seqs)
            for g, table in enumerate(seq.block_tables):
                n = len(table)
                if (
                    table is not entry.tables[g]
                    or n != entry.lengths[g]
                    or (n and table[-1] != entry.lasts[g])
                ):
                    self._write(g, entry.row, table)
                    entry.tables[g], entry.lengths[g], entry.lasts[g] = table, n, table[-1] if n else -1
                widths[g] = max(widths[g], n)
            rows.append(entry.row)
        index = int_tensor(rows)
        return [t[:, :w].index_select(0, index) for t, w in zip(self.tables, widths)]

    def _write(self, group: int, row: int, table: list[int]) -> None:
        buf = self.tables[group]
        if len(table) > buf.shape[1]:  # wider tables: double the width
            wider = self._empty(buf.shape[0], max(len(table), 2 * buf.shape[1]))
            wider[:, : buf.shape[1]] = buf
            buf = self.tables[group] = wider
        if table:
            buf[row, : len(table)] = int_tensor(table, torch.int32)

    def _new_row(self, step_seqs: list) -> _Row:
        if not self._free:  # rows of sequences that no longer run (finished, preempted) go back
            live = {s.seq_id for s in step_seqs}
            for seq_id in [k for k in self._rows if k not in live]:
                self._free.append(self._rows.pop(seq_id).row)
        if not self._free:  # more sequences than rows: twice the rows
            old = self.tables[0].shape[0]
            self.tables = [torch.cat([t, self._empty(old, t.shape[1])]) for t in self.tables]
            self._free = list(range(2 * old - 1, old - 1, -1))
        G = self.num_groups
        return _Row(self._free.pop(), [None] * G, [0] * G, [-1] * G)

    def check(self, seqs: list) -> None:
        """Each sequence's row equals its tables, pages behind a window aside (AssertionError otherwise)."""
        for seq in seqs:
            entry = self._rows[seq.seq_id]
            for g, table in enumerate(seq.block_tables):
                row = self.tables[g][entry.row, : len(table)].tolist()
                for b, (want, got) in enumerate(zip(table, row)):
                    assert want == got or want == -1, (seq.seq_id, g, b, want, got)


def slot_mapping(tables: torch.Tensor, token_seq: torch.Tensor, positions: torch.Tensor, page_size: int):
    """[T] int64: the cache slot of each new token, from the step's tables [S, W], each token's sequence [T]
    and position [T] (host tensors)."""
    pages = tables[token_seq, positions // page_size].long()
    return pages * page_size + positions % page_size
