"""Hybrid models' state slots (engine/model/state_cache.py): each stateful layer's conv and recurrent states in a slot
per sequence, swapped bit for bit, copied for parallel samples, counted in the statistics; against HF `generate`
on tiny random-weight models of tests/model_families.py (test_families.py runs the whole matrix)."""

from __future__ import annotations

import pytest
import torch
from helpers import run_engine
from model_families import HYBRID, WHOLE_PROMPTS
from test_families import NEW_TOKENS, hf_tokens, model_and_reference, models, prompts, run

from batchrun.engine import Engine, EngineConfig, LoadedModel, SamplingParams
from batchrun.engine.core.cache_spec import LayerStates, StateShape, StateSpec, UnitCopies, UnitCopy
from batchrun.engine.core.sequence import Sequence
from batchrun.engine.core.state_slots import SequenceSlots, StateSlots
from batchrun.engine.model.state_cache import StateCache
from batchrun.errors import BadInput

FAMILY = "qwen3_5_text"  # 3 Gated DeltaNet layers (a conv and a recurrent state each) : 1 attention


@pytest.mark.parametrize("family", [FAMILY, "nemotron_h", "lfm2", "inkling2_text"])
def test_swap_moves_the_states_and_equals_hf(family):
    """A pool too small for every sequence: sequences are swapped out (pages and state slot) and back, and every
    completion still equals HF `generate`; the slot bookkeeping holds at every step."""
    model, expected = model_and_reference(family)
    swaps = []

    def check(eng, result):
        eng.check_integrity()
        swaps.append((len(result.plan.unit_copies[0].swap_out), len(result.plan.unit_copies[0].swap_in)))

    got, steps, engine = run(model, family, "torch", full_pages=8, preemption="swap", on_step=check)
    assert sum(o for o, _ in swaps) > 0 and sum(i for _, i in swaps) > 0, "no state was swapped"
    assert not any(s.plan.recomputed for s in steps), "swap fell back to recompute"
    assert got == expected
    assert (
        engine.kv.managers[0].num_used == 0
        and engine.kv.managers[0].num_free_cpu == engine.kv.managers[0].num_cpu_slots
    )


def test_swap_copies_a_slot_bit_for_bit():
    spec = StateSpec(
        (LayerStates(0, (StateShape((6, 4), torch.float32),), (StateShape((2, 3, 3), torch.bfloat16),)),)
    )
    cache = StateCache(spec, num_slots=4, num_cpu_slots=2, device=torch.device("cpu"))
    for t in cache.tensors:
        t.copy_(torch.randn(t.shape).to(t.dtype))
    before = [t[1].clone() for t in cache.tensors]
    cache.apply(UnitCopies(swap_out=[UnitCopy(1, 0)]))
    for t in cache.tensors:
        t[1].zero_()
    cache.apply(UnitCopies(swap_in=[UnitCopy(0, 3)]))
    for t, b in zip(cache.tensors, before):
        assert torch.equal(t[3], b)
    cache.apply(UnitCopies([UnitCopy(3, 2)]))  # a fork's copy
    for t, b in zip(cache.tensors, before):
        assert torch.equal(t[2], b)


@pytest.mark.parametrize("family", sorted(HYBRID))
def test_parallel_samples_copy_the_state(family):
    """n = 2 greedy samples: the second is forked after the prompt with a copy of the first's state; both equal
    HF `generate`."""
    ours, ref = models(family)
    token_lists = prompts(256)
    expected = hf_tokens(ref, token_lists)
    engine = Engine(
        LoadedModel(ours), EngineConfig(device="cpu", num_pages=256, max_num_seqs=8), torch.device("cpu")
    )
    forks = []
    seqs, _ = run_engine(
        engine,
        token_lists,
        SamplingParams(max_new_tokens=NEW_TOKENS, n=2),
        on_step=lambda e, r: (e.check_integrity(), forks.append(len(r.plan.unit_copies[0].device))),
    )
    assert sum(forks) == len(token_lists)
    for i, samples in enumerate(seqs):
        assert [s.output_token_ids for s in samples] == [expected[i]] * 2, f"prompt {i}"


def test_more_samples_than_state_slots_is_the_rows_error():
    """n samples hold n state slots at once: with fewer slots than that (max_num_seqs), the row cannot ever be
    admitted and is refused at once, rather than left waiting with the engine stalled."""
    ours, _ = models(FAMILY)
    engine = Engine(
        LoadedModel(ours), EngineConfig(device="cpu", num_pages=64, max_num_seqs=2), torch.device("cpu")
    )
    assert engine.admission_error(8, SamplingParams(max_new_tokens=4, n=2)) is None
    reason = engine.admission_error(8, SamplingParams(max_new_tokens=4, n=3))
    assert reason and "3 state slots" in reason and "has 2" in reason, reason


def test_the_matrix_sees_a_dropped_state(monkeypatch):
    """The comparison can fail: layers that start every step from no state (what running a hybrid as if it were
    attention alone computes) differ from HF `generate`."""
    from batchrun.engine.model import state_cache

    model, expected = model_and_reference(FAMILY)
    real = state_cache.linear_layer
    monkeypatch.setattr(state_cache, "linear_layer", lambda c, r, has_previous: real(c, r, False))
    got, _, _ = run(model, FAMILY, "gather")
    assert got != expected


def test_statistics_count_state_slots():
    """Every step: state slots in use from the slot manager equal a recount over the running sequences, and one
    slot is held per running sequence (plus those reserved for samples still to fork)."""
    model, _ = model_and_reference(FAMILY)
    engine = Engine(
        LoadedModel(model), EngineConfig(device="cpu", num_pages=64, max_num_seqs=4), torch.device("cpu")
    )
    used = []

    def check(eng, result):
        counted = eng.memory_snapshot()
        assert counted == eng.memory_snapshot(recount=True)
        held = sum(1 + len(eng.kv.managers[0].sequences[s.seq_id].reserved) for s in eng.running_sequences())
        assert counted.usage == {"state_slots_total": 4, "state_slots_used": held}
        used.append(held)

    run_engine(engine, prompts(256), SamplingParams(max_new_tokens=4, n=2), on_step=check)
    assert max(used) == 4 and engine.unit_bytes()["bytes_per_state_slot"] > 0


def test_slot_bookkeeping_catches_a_double_hold():
    slots = StateSlots(3, 1)
    a, b = (Sequence(i, [1, 2], SamplingParams(n=2)) for i in range(2))
    a.num_siblings_to_fork = 1
    slots.allocate(a)  # its own slot and one reserved for its fork
    assert slots.num_free == 1 and slots.held_by(a) == [slots.unit_of(a), *slots.sequences[0].reserved]
    slots.check([a], [])
    slots.sequences[b.seq_id] = SequenceSlots(slot=slots.unit_of(a))  # two sequences on one slot
    with pytest.raises(AssertionError):
        slots.check([a, b], [])


def test_the_budget_is_split_by_what_the_scheduler_needs():
    """max_num_seqs slots when the budget holds them with a page per KV cache group each; fewer when it does
    not, or when they would take more than half of it; a budget that holds no sequence is a bad job naming the
    key."""
    from batchrun.engine.model.sizing import pool_sizes

    cpu = torch.device("cpu")
    # a state slot of 10,000 bytes: one stateful layer's 2,500 fp32 values
    spec = StateSpec((LayerStates(0, (StateShape((2500,), torch.float32),), ()),))
    roomy = pool_sizes(EngineConfig(kv_cache_memory="1MiB", max_num_seqs=8), 1000, 1, spec, cpu)
    # 8 slots for sequences, 2 keeping shared prefixes' states (a quarter as many), the rest pages
    assert (roomy.states.num_slots, roomy.states.num_snapshots) == (8, 2)
    assert roomy.num_pages == (2**20 - 10 * 10_000) // 1000
    config = EngineConfig(kv_cache_memory="50000", max_num_seqs=8, prefix_sharing=False)
    tight = pool_sizes(config, 1000, 2, spec, cpu)
    # one page a slot would allow 4 slots (50,000 // 12,000); at most half the budget in slots allows 2
    assert tight.states.num_slots == 2 and tight.num_pages == (50_000 - 2 * 10_000) // 1000
    assert tight.states.num_snapshots == 0
    with pytest.raises(BadInput, match="kv_cache_memory"):
        pool_sizes(EngineConfig(kv_cache_memory="5000"), 1000, 1, spec, cpu)


@pytest.mark.parametrize("family", sorted(set(HYBRID) - WHOLE_PROMPTS))
def test_prefix_sharing_restores_the_state_at_the_prefix_end(family):
    """Rows sharing a system prompt of 3.5 pages: the first computes it and keeps the state at the end of its
    third page; the others start behind the shared pages from a copy of that state. Every row equals HF
    `generate`, and the rows after the first computed none of the shared pages."""
    ours, ref = models(family)
    gen = torch.Generator().manual_seed(5)
    system = torch.randint(3, 256, (56,), generator=gen).tolist()
    rows = [system + torch.randint(3, 256, (n,), generator=gen).tolist() for n in (3, 9, 20, 1, 30, 14)]
    expected = hf_tokens(ref, rows)
    engine = Engine(
        LoadedModel(ours),
        EngineConfig(device="cpu", num_pages=64, max_num_seqs=4, max_num_batched_tokens=256),
        torch.device("cpu"),
    )
    restores = []
    seqs, _ = run_engine(
        engine,
        rows,
        SamplingParams(max_new_tokens=NEW_TOKENS),
        on_step=lambda e, r: (e.check_integrity(), restores.append(len(r.plan.unit_copies[0].device))),
    )
    assert [s[0].output_token_ids for s in seqs] == expected
    slots = engine.kv.managers[0]
    assert slots.snapshots_taken == 1 and slots.snapshots_restored == len(rows) - 1
    assert engine.block_manager.prefix_cache.hit_tokens == 48 * (len(rows) - 1)


def test_a_prefix_without_a_kept_state_is_computed():
    """Pages of a prefix are cached but no state was kept at their end (no waiting row shared it when the
    first was admitted): a later row computes the prefix again rather than start from a wrong state."""
    ours, ref = models(FAMILY)
    system = list(range(3, 60))
    rows = [system + [100], system + [101]]
    engine = Engine(LoadedModel(ours), EngineConfig(device="cpu", num_pages=64), torch.device("cpu"))
    first, _ = run_engine(engine, rows[:1], SamplingParams(max_new_tokens=4))
    second, _ = run_engine(engine, rows[1:], SamplingParams(max_new_tokens=NEW_TOKENS))
    assert second[0][0].output_token_ids == hf_tokens(ref, rows[1:])[0]
    assert engine.block_manager.prefix_cache.hit_tokens == 0 and engine.kv.managers[0].snapshots_taken == 0


def test_a_layer_that_drops_the_state_it_is_given_runs_whole_prompts(monkeypatch):
    """Jamba's Mamba scan takes no initial state (HF `generate` only runs it over a whole prompt): the probe
    finds that its prompt form does not continue a state, so every prompt is computed whole in one step, past
    the token budget when it is the step's first, and no prefix state is kept. Equal to HF `generate`; with
    the probe's verdict lifted, chunked prompts differ."""
    from batchrun.engine.model.state_cache import StateProbe

    model, expected = model_and_reference("jamba")
    rows = prompts(256)
    got, steps, engine = run(model, "jamba", "torch", max_num_batched_tokens=16)
    assert not engine.plan.attention.states.continues_state and engine.kv.managers[0].num_snapshots == 0
    lengths = {len(p) for p in rows}
    for step in steps:
        for s in step.plan.scheduled:
            if s.num_new_tokens > 1:
                assert s.start == 0 and s.num_new_tokens in lengths, "a prompt was cut into chunks"
    assert any(step.plan.num_batched_tokens > 16 for step in steps)  # a long prompt alone, past the budget
    assert got == expected
    monkeypatch.setattr(StateProbe, "continues_state", lambda self: True)
    chunked, _, _ = run(model, "jamba", "torch", max_num_batched_tokens=16)
    assert chunked != expected
