"""Preemption: with a quarter of the pages the workload wants, every row still finishes with the same greedy
completion, by swapping to the CPU pool or by recomputing."""

import pytest
from helpers import make_engine, run_engine

from batchrun.engine import SamplingParams

PARAMS = SamplingParams(max_new_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def workload(tok_model):
    """Short prompts with long outputs: pages run out mid-generation, not at admission."""
    from helpers import chat_ids

    tok, _ = tok_model
    subjects = [
        "rivers",
        "stars",
        "cats",
        "tea",
        "maps",
        "snow",
        "ships",
        "songs",
        "trees",
        "bread",
        "kites",
        "glass",
    ]
    return [chat_ids(tok, f"Tell me about {s}.") for s in subjects]


@pytest.fixture(scope="module")
def unconstrained(tok_model, workload):
    engine = make_engine(tok_model, num_pages=1024)
    peak = 0

    def watch(eng, _):
        nonlocal peak
        peak = max(peak, eng.num_used_pages)

    seqs, steps = run_engine(engine, workload, PARAMS, on_step=watch)
    assert not any(s.plan.preempted for s in steps)
    return [s[0].output_token_ids for s in seqs], peak


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_quarter_memory_finishes_every_row_with_the_same_completions(
    tok_model, workload, unconstrained, mode
):
    expected, peak_need = unconstrained
    num_pages = peak_need // 4
    longest = max(len(p) for p in workload) + PARAMS.max_new_tokens
    assert num_pages * 16 >= longest, "the test workload must still fit one sequence"
    engine = make_engine(tok_model, num_pages=num_pages, preemption=mode, num_cpu_pages=256)
    swap_out = swap_in = 0

    def check(eng, result):
        nonlocal swap_out, swap_in
        swap_out += len(result.plan.swap_out)
        swap_in += len(result.plan.swap_in)
        eng.check_integrity()

    seqs, steps = run_engine(engine, workload, PARAMS, on_step=check)
    preemptions = sum(len(r.plan.preempted) for r in steps)
    recomputations = sum(len(r.plan.recomputed) for r in steps)
    got = [s[0].output_token_ids for s in seqs]
    assert got == expected
    preempted = [s[0] for s in seqs if s[0].num_preemptions > 0]
    assert len(preempted) >= len(workload) / 3, f"only {len(preempted)} of {len(workload)} preempted"
    bm = engine.block_manager
    bm.check_integrity([])
    assert bm.num_free_pages == bm.num_pages and bm.cpu_pool.num_free == bm.num_cpu_pages
    assert swap_out == swap_in
    assert preemptions == sum(s[0].num_preemptions for s in seqs)
    if mode == "swap":
        assert swap_out > 0 and recomputations == 0
    else:
        assert swap_out == 0 and recomputations == preemptions > 0


def test_full_cpu_pool_falls_back_to_recompute(tok_model, workload, unconstrained):
    expected, peak_need = unconstrained
    engine = make_engine(tok_model, num_pages=peak_need // 4, preemption="swap", num_cpu_pages=0)
    seqs, steps = run_engine(engine, workload, PARAMS)
    assert [s[0].output_token_ids for s in seqs] == expected
    recomputations = sum(len(r.plan.recomputed) for r in steps)
    assert recomputations == sum(len(r.plan.preempted) for r in steps) > 0


def test_row_that_can_never_fit_is_refused_up_front(tok_model):
    engine = make_engine(tok_model, num_pages=4)
    assert engine.admission_error(10, SamplingParams(max_new_tokens=200)) is not None
    assert engine.admission_error(10, SamplingParams(max_new_tokens=20)) is None
    assert "max_model_len" in make_engine(tok_model, max_model_len=32).admission_error(40, PARAMS)
