"""The model runner's input batch (engine/input_batch.py): rows added, forked, appended to and given back keep each
request's tokens, through growth in rows and in width."""

from __future__ import annotations

from batchrun.engine.input_batch import InputBatch, NewRequest


def _tokens(batch: InputBatch, req_id: int) -> list[int]:
    row = batch.row_of[req_id]
    return batch.token_ids[row, : batch.num_tokens[row]].tolist()


def test_rows_follow_requests_through_growth():
    batch = InputBatch(2, width=4)
    batch.add([NewRequest(10, [1, 2, 3], 3, None), NewRequest(11, [4, 5], 2, 7)])
    batch.fork(11, 12)  # a third row: the rows double
    batch.append([10, 11, 12], [6, 8, 9])  # row 10 reaches its width: the rows widen
    assert _tokens(batch, 10) == [1, 2, 3, 6]
    assert _tokens(batch, 11) == [4, 5, 8]
    assert _tokens(batch, 12) == [4, 5, 9]
    assert batch.adapters[batch.row_of[12]] == 7 and batch.num_prompt_tokens[batch.row_of[12]] == 2
    for _ in range(10):
        batch.append([10], [0])
    assert _tokens(batch, 10) == [1, 2, 3, 6] + [0] * 10
    rows = batch.rows([12, 10])
    assert batch.decode_ids(rows, [2, 3]).tolist() == [9, 6]
    assert batch.slice_ids(rows[1], 1, 4).tolist() == [2, 3, 6]
    batch.remove([10, 99])  # a request without a row is passed over
    assert 10 not in batch.row_of
    batch.add([NewRequest(13, [5], 1, None)])  # takes the row given back
    assert _tokens(batch, 13) == [5] and len(batch.row_of) == 3
    batch.add([NewRequest(13, [5, 6, 7], 1, None)])  # readmitted for recompute: its row rewritten
    assert _tokens(batch, 13) == [5, 6, 7]
    batch.clear()
    assert not batch.row_of
