"""The model runner's input batch (engine/worker/input_batch.py): rows added, forked, appended to and given back keep each
request's tokens, through growth in rows and in width."""

from __future__ import annotations

from batchrun.engine.core.scheduler_output import NewRequest
from batchrun.engine.worker.input_batch import InputBatch


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


def test_a_steps_rows_are_reused_only_for_the_same_requests_in_the_same_order():
    """`rows` gives the last step's rows back for the same ids in the same order (most decode steps) and looks
    them up again otherwise: other ids or order, the caller's list changed after, a row given back (another
    request may take it), no ids at all."""
    batch = InputBatch(4, width=4)
    batch.add([NewRequest(i, [i], 1, None) for i in (10, 11, 12)])
    ids = [12, 10]
    assert batch.rows(ids).tolist() == [2, 0]
    ids.append(11)  # the caller's list, changed after it was kept
    kept = batch.rows(ids)
    assert kept.tolist() == [2, 0, 1] and batch.rows([12, 10, 11]) is kept
    assert batch.rows([10, 12]).tolist() == [0, 2]  # another order: looked up (and kept)
    batch.remove([10])
    assert batch.rows([]).tolist() == []
    batch.add([NewRequest(13, [13], 1, None)])  # takes row 0, given back by 10
    assert batch.rows([12, 13]).tolist() == [2, 0]
    batch.append([12, 13], [7, 8])  # the step's tokens onto the rows it ran
    assert _tokens(batch, 12) == [12, 7] and _tokens(batch, 13) == [13, 8]


def test_integrity_check_catches_a_stale_table_or_position():
    """The runner's rows follow the plan's changes alone (new block ids, computed counts): after each step of a
    small engine they equal the block manager's tables and the sequences' counts, and a row written wrong (a
    page, a computed count) is what `Engine.check_integrity` reports."""
    import pytest
    import torch
    from helpers import paged_model_from_config
    from transformers import LlamaConfig

    from batchrun.engine import Engine, EngineConfig, LoadedModel, SamplingParams

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128,
    )  # fmt: skip
    model = paged_model_from_config(config).eval()
    engine_config = EngineConfig(
        device="cpu", num_pages=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=64, attention="torch"
    )
    engine = Engine(LoadedModel(model, None, max_model_len=128), engine_config, torch.device("cpu"))
    for i in range(3):  # page size 4: every fourth decode takes a page, written into its row as one entry
        engine.add([3 + i, 5, 7, 9, 11][: 3 + i], SamplingParams(max_new_tokens=9))
    for _ in range(6):
        engine.step()
        engine.check_integrity()
    batch, seq = engine.runner.batch, next(iter(engine.scheduler.running))
    row = batch.row_of[seq.seq_id]
    page = batch.block_tables.tables[0][row, 1].item()
    batch.block_tables.tables[0][row, 1] = page + 1  # a stale page
    with pytest.raises(AssertionError):
        engine.check_integrity()
    batch.block_tables.tables[0][row, 1] = page
    engine.check_integrity()
    batch.num_computed[row] += 1  # a stale position
    with pytest.raises(AssertionError):
        engine.check_integrity()
