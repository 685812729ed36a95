"""The running sequences as columns, the arrays the scheduler plans every step over (scheduler.py).

A step's plan for a running sequence is, almost always, the decode of the token it generated last: one token at
its computed count, into a page it has or, crossing into a new page, one more page in each group. These columns
(each row a sequence of `Scheduler.running`, in its order) hold what decides that: the tokens computed, the
tokens there are, the prompt's length, the tokens its pages hold (`rooms`), each kind's units its step reads (a
hybrid's state slot) and, for a windowed model, each group's first block its queries read. The scheduler finds
the decodes with a few vector operations and loops only over the rows that are something else (a prompt chunk,
a window giving pages back, a prefix state kept, a page shortage).

They are made from the sequences when the running set changes (`Scheduler._enter`, `_leave` drop them) and kept
in step after each step by `advance`; `check` holds them against the sequences and the block manager
(Engine.check_integrity).
"""

from __future__ import annotations

import numpy as np

from batchrun.engine.core.block_manager import BlockManager
from batchrun.engine.core.sequence import NULL_PAGE


class RunningRows:
    def __init__(self, seqs: list, bm: BlockManager, units_of):
        self.seqs = seqs
        self.ids = np.array([s.seq_id for s in seqs], dtype=np.int64)
        self.computed = np.array([s.num_computed_tokens for s in seqs], dtype=np.int64)
        self.num_tokens = np.array([s.num_tokens for s in seqs], dtype=np.int64)
        self.prompt = np.array([s.num_prompt_tokens for s in seqs], dtype=np.int64)
        self.rooms = np.zeros(len(seqs), dtype=np.int64)  # set with the windows' columns (`replanned`)
        # whether the runner lacks some of its tables (a fork's, the general path hands them on)
        self.unsent = np.zeros(len(seqs), dtype=bool)
        self.units = [units_of(s) for s in seqs]
        # the groups that give pages back behind a window, and in each the entries each row gave back so far (a
        # run at the head of its table): a decode whose window has moved past more is planned by the general path,
        # whose `trim` gives them back
        self.windowed = [g for g, f in enumerate(bm.layout.first_keys) if f(1 << 40) > 0]
        self.given_back = [np.zeros(len(seqs), dtype=np.int64) for _ in self.windowed]
        for i in range(len(seqs)):
            self.replanned(i, bm)
        self.planned = np.zeros(len(seqs), dtype=np.int64)  # tokens each computes in the step being planned

    def __len__(self) -> int:
        return len(self.seqs)

    def replanned(self, i: int, bm: BlockManager) -> None:
        """Row i's pages as the general path left them (grown, given back behind a window)."""
        record = bm.sequences[int(self.ids[i])]
        tables = record.tables
        self.rooms[i] = bm.page_size * min(map(len, tables))
        self.unsent[i] = record.unsent is not None
        for k, g in enumerate(self.windowed):
            table = tables[g]
            self.given_back[k][i] = next((b for b, page in enumerate(table) if page != NULL_PAGE), len(table))

    def decodes(self, bm: BlockManager, snapshot_ends: dict) -> np.ndarray:
        """[S] bool: the rows that decode their last token, a generated one, with nothing given back behind a
        window, no prefix state kept where it ends and every table the runner has (each of the others is planned
        sequence by sequence)."""
        computed = self.computed
        decode = (self.num_tokens - computed == 1) & (computed >= self.prompt) & ~self.unsent
        if snapshot_ends:
            decode &= ~np.isin(self.ids, list(snapshot_ends))
        first = bm.layout.first_block
        for k, g in enumerate(self.windowed):
            decode &= np.array([first(g, c) for c in computed.tolist()], dtype=np.int64) <= self.given_back[k]
        return decode

    def advance(self) -> None:
        """The step planned last ran: each row computed its planned tokens, and one that reached its last token
        sampled one more (a scoring one finished: the running set changed, these columns go)."""
        self.computed += self.planned
        self.num_tokens += (self.planned > 0) & (self.computed == self.num_tokens)
        self.planned[:] = 0

    def check(self, running, bm: BlockManager, units_of) -> None:
        """The columns hold what the sequences and their pages say (AssertionError otherwise)."""
        assert self.seqs == list(running), "the running set changed under its columns"
        for i, seq in enumerate(self.seqs):
            assert self.computed[i] == seq.num_computed_tokens and self.num_tokens[i] == seq.num_tokens, (
                seq.seq_id
            )
            tables = bm.sequences[seq.seq_id].tables
            assert self.rooms[i] == bm.page_size * min(map(len, tables)), seq.seq_id
            assert self.units[i] == units_of(seq), seq.seq_id
