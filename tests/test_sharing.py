"""Shared pages: prefix sharing across rows, and parallel sampling with copy-on-write."""

import pytest
from helpers import chat_ids, make_engine, run_engine

from batchrun.engine import SamplingParams
from batchrun.stats import StatsCollector

SYSTEM = (
    "You are a careful assistant for a museum. " * 4 + "Visitors ask short questions about exhibits, "
    "opening hours, tickets and the building. Answer in one friendly sentence. " * 12
)


@pytest.fixture(scope="module")
def rows(tok_model):
    tok, _ = tok_model
    questions = [f"Question {i}: is room {i} open on day {i % 7}?" for i in range(32)]
    prompts = [chat_ids(tok, q, system=SYSTEM) for q in questions]
    assert all(280 <= len(p) <= 400 for p in prompts), [len(p) for p in prompts]
    return prompts


def run_with_stats(engine, prompts, params, **kw):
    stats = StatsCollector(engine, debug_recount=True)
    seqs, steps = run_engine(engine, prompts, params, on_step=lambda eng, r: stats.record(r), **kw)
    return seqs, stats


def test_shared_system_prompt_is_stored_once(tok_model, rows):
    params = SamplingParams(max_new_tokens=8)
    on, stats_on = run_with_stats(make_engine(tok_model, prefix_sharing=True), rows, params)
    off, stats_off = run_with_stats(make_engine(tok_model, prefix_sharing=False), rows, params)
    assert [s[0].output_token_ids for s in on] == [s[0].output_token_ids for s in off]
    s_on, s_off = stats_on.summary(), stats_off.summary()
    assert s_on["duplication_saved_peak"] >= 0.6, s_on["duplication_saved_peak"]
    assert s_off["duplication_saved_peak"] == 0.0
    assert s_on["prompt_tokens"] == s_off["prompt_tokens"]
    assert s_on["prompt_tokens_computed"] < 0.3 * s_off["prompt_tokens_computed"], (
        s_on["prompt_tokens_computed"],
        s_off["prompt_tokens_computed"],
    )
    assert s_on["prefix_hit_tokens"] > 0 and s_on["peak_pages_used"] < 0.4 * s_off["peak_pages_used"]


def test_parallel_samples_differ_repeat_and_copy_on_write(tok_model, rows):
    params = SamplingParams(max_new_tokens=12, temperature=0.8, n=4, seed=3)
    seeds = [[1000 * i + k for k in range(4)] for i in range(4)]
    prompts = rows[:4]
    runs = []
    for _ in range(2):
        engine = make_engine(tok_model)
        seqs, stats = run_with_stats(engine, prompts, params, seeds=seeds)
        runs.append([[s.output_token_ids for s in row] for row in seqs])
        assert engine.block_manager.num_cow_copies > 0
        assert stats.summary()["duplication_saved_peak"] > 0.5
        assert [s.sample_index for s in seqs[0]] == [0, 1, 2, 3]
    assert runs[0] == runs[1]
    for row in runs[0]:
        assert len({tuple(t) for t in row}) > 1, "the samples of a row should differ"


def test_sharing_under_memory_pressure_with_swapping(tok_model, rows):
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompts = rows[:12]
    free, _ = run_engine(make_engine(tok_model, num_pages=1024), prompts, params)
    engine = make_engine(tok_model, num_pages=40, num_cpu_pages=512, preemption="swap")
    tight, stats = run_with_stats(engine, prompts, params)
    assert [s[0].output_token_ids for s in tight] == [s[0].output_token_ids for s in free]
    assert stats.summary()["swap_out_pages"] > 0 and stats.summary()["preemptions"] > 0
    engine.block_manager.check_integrity([])
    assert engine.block_manager.num_free_pages == 40
