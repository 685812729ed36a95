"""The plain sampling step (OutputProcessor.sample's one argmax where every live request is greedy, with no
grammar, logprobs or stop strings, and every scheduled sequence generates) against the general path (`plain`
off): one workload run each way must give the same tokens, finish reasons and step results, EOS reached and
ignored, the length limit and the context limit reached, and a greedy n=2 whose sample is forked. And the flag
itself: one request that is not plain turns it off while any request is live, and it comes back with the next
plain request once none is."""

from __future__ import annotations

import pytest
from helpers import make_engine, paged_model_from_config
from model_families import perturb, tiny_config

from batchrun.engine.config import SamplingParams

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def tiny(tok_model):
    """A tiny llama (random weights, seed 0) with the embedded model's tokenizer and vocabulary (the grammar's)."""
    import torch

    tok, _ = tok_model
    torch.manual_seed(0)
    model = paged_model_from_config(tiny_config("llama", dict(vocab_size=len(tok)))).eval()
    perturb(model, seed=0)
    return tok, model


def workload(tiny, eos: int | None, plain: bool) -> tuple[list, list]:
    """Each request's samples (tokens, finish reason) and each step's counts."""
    engine = make_engine(tiny, max_model_len=MAX_MODEL_LEN, num_pages=64)
    if eos is not None:  # this model's greedy text reaches this token early: its end of sequence, here
        engine.eos_token_ids.clear()
        engine.eos_token_ids.add(eos)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [40, 41, 42, 43, 44, 45]
    requests = [
        (a, SamplingParams(max_new_tokens=12)),  # EOS
        (a, SamplingParams(max_new_tokens=9, ignore_eos=True)),  # EOS passed: the length limit
        (b, SamplingParams(max_new_tokens=5, n=2)),  # a greedy pair, forked after the prompt
        (list(range(100, 100 + MAX_MODEL_LEN - 4)), SamplingParams(max_new_tokens=20)),  # the context limit
    ]
    for i, (prompt, params) in enumerate(requests):
        engine.add(prompt, params, request=i)
    done, steps = {}, []
    while engine.has_unfinished():
        assert engine.outputs.plain or not plain
        engine.outputs.plain = plain
        r = engine.step()
        engine.check_integrity()  # the scheduler's columns among the rest
        steps.append((r.num_generated, sorted(s.seq_id for s in r.finished), r.sampled))
        for s in r.finished:
            done.setdefault(s.request, []).append((s.sample_index, list(s.output_token_ids), s.finish_reason))
    return [sorted(done[i]) for i in range(len(requests))], steps


def test_plain_sampling_steps_are_the_general_path(tiny):
    probe, _ = workload(tiny, None, True)
    first = probe[0][0][1]
    eos = first[3]  # the greedy text of request 0 ends at its fourth token
    want_eos_at = first.index(eos)
    fast, fast_steps = workload(tiny, eos, True)
    slow, slow_steps = workload(tiny, eos, False)
    assert fast == slow and fast_steps == slow_steps
    assert fast[0] == [(0, first[: want_eos_at + 1], "eos")]
    ((_, tokens, reason),) = fast[1]
    assert reason == "length" and len(tokens) == 9 and eos in tokens[:-1]  # EOS ignored
    assert [(i, len(t), r) for i, t, r in fast[2]] == [(0, 5, "length"), (1, 5, "length")]
    assert fast[2][0][1] == fast[2][1][1]  # greedy samples agree
    ((_, tokens, reason),) = fast[3]
    assert reason == "length" and len(tokens) == 4  # the context's end, before max_new_tokens


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=3, stop=("zz",)),
        SamplingParams(max_new_tokens=3, logprobs=2),
        SamplingParams(max_new_tokens=3, temperature=0.7),
        SamplingParams(max_new_tokens=3, response_format={"type": "json_object"}),
    ],
    ids=["stop", "logprobs", "sampled", "grammar"],
)
def test_one_request_not_plain_turns_the_plain_path_off_while_any_is_live(tiny, params):
    engine = make_engine(tiny, max_model_len=MAX_MODEL_LEN, num_pages=64)
    plain = SamplingParams(max_new_tokens=6)
    assert engine.outputs.plain
    engine.add([1, 2, 3], plain)
    assert engine.outputs.plain
    engine.add([4, 5, 6], params)
    assert not engine.outputs.plain
    engine.step()
    engine.add([7, 8, 9], plain)  # others live: still off
    while engine.has_unfinished():
        assert not engine.outputs.plain
        engine.step()
    engine.add([1, 2, 3], plain)  # none live: on again
    assert engine.outputs.plain
    engine.add([4, 5, 6], params)
    engine.step()
    engine.abort_all()
    engine.add([1, 2, 3], plain)
    assert engine.outputs.plain
