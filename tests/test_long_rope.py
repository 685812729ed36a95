"""LongRoPE (Phi-3.5-mini / Phi-4-mini) and dynamic NTK scaling, their factors chosen per packed sequence
(batchrun/engine/model/ops/per_sequence_rope.py): each row equals HF `generate` on it alone (a freshly loaded model) under
chunked prefill, swap and recompute preemption, prefix sharing of the pages rotated alike and a model that ran
longer sequences before; and what each part is for: without per-sequence factors, without Phi-3's recompute at
the switch, or with every page shared, the rows differ. The matrix (tests/test_families.py, test_family_invariance.py) runs both models on every CPU backend
and checks batch invariance."""

from __future__ import annotations

import pytest
import torch
from helpers import run_engine
from model_families import ORIGINAL_CONTEXT, SUPPORTED
from test_families import NEW_TOKENS, build, hf_tokens, model_and_reference, models, prompts

from batchrun.engine import Engine, EngineConfig, LoadedModel, SamplingParams
from batchrun.engine.attention import UnsupportedModel
from batchrun.engine.model.ops.per_sequence_rope import PerSequenceRope

FAMILIES = ["phi3:longrope", "llama:dynamic_ntk"]


def engine(model, **config) -> Engine:
    cfg = dict(device="cpu", num_pages=128, page_size=16, max_num_batched_tokens=64)
    cfg.update(config)
    return Engine(LoadedModel(model, max_model_len=512), EngineConfig(**cfg), torch.device("cpu"))


def generate(eng: Engine, token_lists: list[list[int]]) -> list[list[int]]:
    seqs, _ = run_engine(eng, token_lists, SamplingParams(max_new_tokens=NEW_TOKENS))
    eng.check_integrity()
    return [s[0].output_token_ids for s in seqs]


def test_the_prompts_and_generations_cross_the_original_context():
    lengths = [len(p) for p in prompts(256)]
    assert min(lengths) < ORIGINAL_CONTEXT < max(lengths)
    assert any(n <= ORIGINAL_CONTEXT < n + NEW_TOKENS for n in lengths), "no generation crosses it"


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_and_preemption_equal_hf_generate(family, preemption):
    """Prompts prefilled 8 tokens a step (each chunk rotated for the whole prompt's length, not the chunk's), and
    sequences preempted (a recomputed sequence's generated tokens keep the rotation they were first computed
    with; Phi-3's all take the factors of the whole length, as its cache drop does)."""
    model, expected = model_and_reference(family)
    eng = engine(model, num_pages=10, max_num_batched_tokens=8, preemption=preemption, swap_space=1 << 22)
    seqs, steps = run_engine(eng, prompts(256), SamplingParams(max_new_tokens=NEW_TOKENS))
    got = [s[0].output_token_ids for s in seqs]
    eng.check_integrity()
    assert any(s.plan.preempted for s in steps), "no sequence was preempted"
    assert got == expected


def common_prefix_prompts() -> list[list[int]]:
    """Prompts on both sides of the original context (32) sharing a 24-token prefix: two within it (28 and 30
    tokens, both crossing it as they generate), two past it (44 and 46 tokens, sharing 40)."""
    prefix = prompts(256)[-1][:24]
    return [prefix + [5] * 4, prefix + [7] * 6, prefix + [9] * 20, prefix + [9] * 20 + [11] * 2]


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_sharing_shares_the_pages_rotated_alike(family):
    """A page's K/V depend on the rotation length its tokens were computed with: the prefix cache shares the
    pages of tokens that every sequence rotates with the original context's factors (the second short prompt
    reuses the first's 24-token prefix: 3 pages of 8), never those of a prompt past the original context (its
    tokens rotated for its own length), nor Phi-3's after its recompute at the switch. Each row equals HF
    `generate` on it alone. Then a prompt just past the original context on the same engine, after the long ones
    finished: it keeps no dynamic NTK length of theirs."""
    model, ref = models(family)
    token_lists = common_prefix_prompts()
    eng = engine(model, prefix_sharing=True, page_size=8)
    assert generate(eng, token_lists) == hf_tokens(ref, token_lists)
    assert eng.block_manager.prefix_cache.hit_tokens == 24
    after = [prompts(256)[3]]  # 33 tokens
    assert generate(eng, after) == hf_tokens(ref, after)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_sharing_of_pages_rotated_for_other_lengths_differs(family):
    """Why the prefix cache shares only pages rotated alike: with every page shared, the prompts past the
    original context reuse the short prompts' pages (rotated with the original factors) and rows differ."""
    model, ref = models(family)
    token_lists = common_prefix_prompts()
    eng = engine(model, prefix_sharing=True, page_size=8)
    eng.block_manager.prefix_cache.shareable_tokens = None
    assert generate(eng, token_lists) != hf_tokens(ref, token_lists)
    assert eng.block_manager.prefix_cache.hit_tokens > 24


@pytest.mark.parametrize("family", FAMILIES)
def test_the_forward_reads_nothing_back_nor_makes_tensors_from_python_data(family):
    """The per-sequence cos/sin are made in `ModelRunner.prepare`; the rotary module's forward only casts them
    (tests/test_no_sync.py's watch, on chunked prompts beside decodes, crossing the original context)."""
    from test_no_sync import watch_engine

    model, _ = models(family)
    token_lists = [prompts(256)[1], prompts(256)[3]]  # 11 and 33 tokens: one crosses the original context
    watched = watch_engine(engine(model, max_num_batched_tokens=16), token_lists)
    assert not watched.reads, watched.reads[0]
    assert not watched.made, watched.made[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_without_per_sequence_factors_rows_differ(family, monkeypatch):
    """Why: the model's own rotary call over the packed step picks the factors of the step's longest sequence
    (and for dynamic NTK keeps the longest length it has seen), and the rows differ from HF on them alone."""
    model, expected = model_and_reference(family)
    monkeypatch.setattr(PerSequenceRope, "step_embeddings", lambda self, spans, positions: None)
    assert generate(engine(model), prompts(256)) != expected


def test_phi3_computes_the_sequence_again_at_the_switch(monkeypatch):
    """Phi-3's `prepare_inputs_for_generation` drops the cache when a sequence first passes the original context:
    every earlier token is computed again with the long factors. batchrun recomputes the sequence there (its
    pages dropped); without that recompute, the rows that cross differ."""
    from batchrun.engine.core.scheduler import Scheduler

    model, expected = model_and_reference("phi3:longrope")
    eng = engine(model)
    assert eng.scheduler.recompute_at == ORIGINAL_CONTEXT + 1
    recomputed = []
    real = Scheduler.recompute
    monkeypatch.setattr(Scheduler, "recompute", lambda self, seq: recomputed.append(seq) or real(self, seq))
    assert generate(eng, prompts(256)) == expected
    crossing = [p for p in prompts(256) if len(p) <= ORIGINAL_CONTEXT < len(p) + NEW_TOKENS]
    assert sorted(s.num_prompt_tokens for s in recomputed) == sorted(len(p) for p in crossing)
    eng = engine(model)
    eng.scheduler.recompute_at = None
    got = generate(eng, prompts(256))
    for p, g, e in zip(prompts(256), got, expected):
        assert (g == e) == (p not in crossing), f"prompt of {len(p)} tokens"


def test_dynamic_ntk_where_the_model_recomputes_at_the_switch_is_refused(monkeypatch):
    """Dynamic NTK on a model whose cache is dropped at the original context (Phi-3's configs take LongRoPE only,
    so a Llama said to do it): the drop would mix both rules (generated tokens keep their rotation, but all are
    rotated again once), which is not computed per sequence; refused at load naming it."""
    from batchrun.engine.model.ops import per_sequence_rope

    monkeypatch.setattr(per_sequence_rope, "recomputes_cache_at_original_context", lambda model: True)
    model = build("llama:dynamic_ntk", SUPPORTED["llama:dynamic_ntk"][1], "paged")
    with pytest.raises(UnsupportedModel, match="llama.*dynamic"):
        engine(model)


def test_dynamic_ntk_on_one_layer_type_is_refused():
    """Gemma 3 with dynamic NTK on its full layers alone: RoPE types per layer type are not chosen per sequence;
    refused at load naming the scaling, never a crash on the dict of types."""
    overrides = dict(SUPPORTED["gemma3_text"][1])
    overrides["rope_parameters"] = {
        "full_attention": dict(rope_type="dynamic", factor=4.0, rope_theta=10000.0),
        "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
    }
    model = build("gemma3_text", overrides, "paged")
    with pytest.raises(UnsupportedModel, match="gemma3_text.*`dynamic`.*per layer type"):
        engine(model)


def test_longrope_outside_the_phi3_family_keeps_each_tokens_rotation():
    """LongRoPE on a Llama, whose `generate` never drops its cache: the prompt's tokens keep the short factors
    after the sequence passes the original context, the generated ones past it take the long ones; equal to HF
    `generate` on each prompt alone, with chunked prompts."""
    from model_families import perturb

    rope = SUPPORTED["phi3:longrope"][1]["rope_parameters"]
    overrides = dict(rope_parameters=rope, max_position_embeddings=128)
    model, ref = build("llama", overrides, "paged"), build("llama", overrides, "eager")
    perturb(model, seed=3)
    ref.load_state_dict(model.state_dict())
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    eng = engine(model, max_num_batched_tokens=16)
    assert eng.scheduler.recompute_at is None
    token_lists = [prompts(256)[i] for i in (0, 1, 3)]  # 4, 11 (crossing) and 33 tokens
    assert generate(eng, token_lists) == hf_tokens(ref, token_lists)


def rotary_module(model) -> torch.nn.Module:
    (module,) = [m for m in model.modules() if getattr(m, "rope_type", None) == "dynamic"]
    return module


def own_call(module, positions: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A freshly made rotary module of the same class and config, called as the model calls it on a sequence of
    `length` tokens (position length - 1 among the ids), at `positions`."""
    fresh = type(module)(module.config)
    cos, sin = fresh(torch.empty(0), torch.tensor([positions + [length - 1]]))
    return cos[:, :-1], sin[:, :-1]


DYNAMIC_SHAPES = {  # head_dim, partial rotary factor, original context, factor: odd and even halves, partial
    "family": None,
    "head 40, context 100": dict(head_dim=40, max_position_embeddings=100, factor=2.5),
    "head 128 half rotary": dict(
        head_dim=128, max_position_embeddings=64, factor=8.0, partial_rotary_factor=0.5
    ),
}


@pytest.mark.parametrize("shape", DYNAMIC_SHAPES)
def test_dynamic_ntk_frequencies_of_many_lengths_equal_the_modules_own_call(shape):
    """Dynamic NTK's cos/sin, computed for all the step's lengths at once, equal bit for bit the model's own
    rotary module called on a sequence of each length alone (below, at and past the original context), in one
    step of mixed lengths as in one of a single length."""
    overrides = dict(SUPPORTED["llama:dynamic_ntk"][1])
    if DYNAMIC_SHAPES[shape]:
        s = dict(DYNAMIC_SHAPES[shape])
        rope = dict(rope_type="dynamic", rope_theta=10000.0, factor=s.pop("factor"))
        if "partial_rotary_factor" in s:
            rope["partial_rotary_factor"] = s.pop("partial_rotary_factor")
        overrides.update(s, rope_parameters=rope)
    model = build("llama:dynamic_ntk", overrides, "paged")
    rope = PerSequenceRope.of(model, {"dynamic"})
    assert rope.frequencies is not None
    original = rope.original_context
    lengths = list(range(1, 5 * original))
    mixed_positions = [length - 1 for length in lengths]
    cos, sin = rope.frequencies.embeddings(lengths, torch.tensor(mixed_positions))
    for t, length in enumerate(lengths):
        positions = sorted({0, length // 2, length - 1})
        expected = own_call(rope.module, positions, length)
        got = rope.frequencies.embeddings([length] * len(positions), torch.tensor(positions))
        assert all(torch.equal(e, g) for e, g in zip(expected, got)), f"length {length}"
        assert torch.equal(cos[:, t], expected[0][:, -1]) and torch.equal(sin[:, t], expected[1][:, -1])


def test_dynamic_ntk_step_of_many_decodes_makes_no_rotary_call_per_sequence():
    """The cost: a step of 64 decodes past the original context, each of its own length, computes their cos/sin
    without calling the rotary module once per sequence (64 calls before, 11 ms of CPU time a step: bench/RESULTS.md)."""
    rope = PerSequenceRope.of(
        build("llama:dynamic_ntk", SUPPORTED["llama:dynamic_ntk"][1], "paged"), {"dynamic"}
    )
    calls = []
    real = rope.module._batchrun_rope_forward
    rope.module._batchrun_rope_forward = lambda *a: calls.append(a) or real(*a)
    # each decode's (tokens, prompt tokens, start, tokens this step): prompts of 40.. tokens, 8 generated
    step = [(48 + i, 40 + i, 47 + i, 1) for i in range(64)]
    positions = torch.tensor([start for _, _, start, _ in step])
    cos, _ = rope.step_embeddings(step, positions)
    assert not calls
    length = step[7][0]
    assert torch.equal(cos[:, 7], own_call(rope.module, [length - 1], length)[0][:, 0])


def test_a_rotary_module_with_its_own_forward_is_called_per_length():
    """A dynamic NTK module whose forward is not transformers' standard one (here: positions shifted by half a
    step) is not reproduced: batchrun calls the module itself per length, and the step equals its own call."""
    from transformers.modeling_rope_utils import dynamic_rope_update

    model = build("llama:dynamic_ntk", SUPPORTED["llama:dynamic_ntk"][1], "paged")
    module = rotary_module(model)

    class ShiftedRotary(type(module)):
        @dynamic_rope_update
        def forward(self, x, position_ids):
            freqs = (position_ids[..., None].float() + 0.5) * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    module.__class__ = ShiftedRotary
    rope = PerSequenceRope.of(model, {"dynamic"})
    assert rope.frequencies is None
    length = 2 * ORIGINAL_CONTEXT + 1
    assert all(
        torch.equal(a, b)
        for a, b in zip(rope._rotary(torch.tensor([3]), length), own_call(module, [3], length))
    )
