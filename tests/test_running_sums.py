"""The scheduler's running sums (reserved and computed tokens over the running sequences, which the statistics
read every step instead of passing over the sequences) equal a recount from the sequences after every step:
through swap and recompute preemption, forked samples, sequences finishing, the plain decode path and the
general one, and an abort; and the statistics' memory snapshot equals its slot-by-slot recount."""

import pytest
from helpers import make_engine

from batchrun.engine import SamplingParams
from batchrun.stats import check_snapshot


def recounted(engine) -> tuple[int, int]:
    running = engine.running_sequences()
    return sum(s.reserved_tokens for s in running), sum(s.num_computed_tokens for s in running)


def kept(engine) -> tuple[int, int]:
    scheduler = engine.scheduler
    return scheduler.running_reserved_tokens, scheduler.running_computed_tokens


def prompts(tok_model, count: int) -> list[list[int]]:
    from helpers import chat_ids

    tok, _ = tok_model
    return [chat_ids(tok, f"Write a few lines about the number {i}.") for i in range(count)]


@pytest.mark.parametrize(
    "mode, params, sharing",
    [
        # greedy, no stop strings: the output processor's plain decode path, pages unshared (memory.count's
        # short cut reads the computed sum)
        ("swap", SamplingParams(max_new_tokens=48, ignore_eos=True), False),
        ("recompute", SamplingParams(max_new_tokens=48, ignore_eos=True), False),
        # two sampled samples per prompt: forks, shared pages, the general path
        ("swap", SamplingParams(max_new_tokens=40, n=2, temperature=0.8, seed=3), True),
        ("recompute", SamplingParams(max_new_tokens=40, n=2, temperature=0.8, seed=3), True),
    ],
)
def test_running_sums_equal_a_recount_every_step(tok_model, mode, params, sharing):
    # few pages: sequences are preempted (and come back) mid-generation
    engine = make_engine(tok_model, num_pages=24, preemption=mode, num_cpu_pages=256, prefix_sharing=sharing)
    for i, p in enumerate(prompts(tok_model, 8)):
        engine.add(p, params, request=i)
    preempted = forked = finished = steps = 0
    while engine.has_unfinished():
        result = engine.step()
        steps += 1
        preempted += result.num_preempted
        forked += len(result.forks)
        finished += len(result.finished)
        assert kept(engine) == recounted(engine), f"step {steps}"
        check_snapshot(engine, engine.memory_snapshot())  # every field against the slot-by-slot recount
    assert preempted > 0, "the workload must preempt"
    assert finished == 8 * params.n
    assert forked == (8 if params.n == 2 else 0)
    assert kept(engine) == (0, 0)


def test_running_sums_after_an_abort_and_a_new_request(tok_model):
    engine = make_engine(tok_model, num_pages=64, prefix_sharing=False)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    for p in prompts(tok_model, 4):
        engine.add(p, params)
    for _ in range(3):
        engine.step()
        assert kept(engine) == recounted(engine)
    assert kept(engine)[0] > 0
    engine.abort_all()
    assert kept(engine) == recounted(engine) == (0, 0)
    engine.add(prompts(tok_model, 1)[0], params)
    while engine.has_unfinished():
        engine.step()
        assert kept(engine) == recounted(engine)
        check_snapshot(engine, engine.memory_snapshot())
