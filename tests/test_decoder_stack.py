"""batchrun's own outer forward (engine/decoder_stack.py) against HF's: the same logits, bit for bit, at every step
of one workload (chunked prompts, steps where nothing samples, decodes); the families whose outer forwards do
more than the known forms keep HF's; a hook on either outer module still sees every call."""

import pytest
import torch
from model_families import SUPPORTED, perturb, tiny_config
from test_families import build, family_engine, prompts

from batchrun.engine import SamplingParams, decoder_stack
from batchrun.engine.decoder_stack import DecoderStack, HFForward

# families whose outer forwards are the known forms (Llama's; Qwen2's per-layer-type masks; the config's own
# layer kinds: q/k norms, NoPE layers, partial rotary, post-norms, dynamic NTK's stateful rotary module)
STACKED = ["llama", "qwen2", "qwen3", "smollm3", "olmo2", "glm", "llama:dynamic_ntk"]


def recorded_run(family: str, forward_class) -> tuple[list, list]:
    """The family's model (perturbed as the matrix perturbs it) on `forward_class`: each forward call's logits
    (None for a step that runs the decoder alone) and the tokens."""
    model = build(family, SUPPORTED[family][1], "paged")
    perturb(model, seed=len(family))
    engine = family_engine(model, "torch")  # a 64-token budget: the long prompts run in chunks
    runner = engine.runner
    assert type(runner.forward) is (DecoderStack if family in STACKED else HFForward)
    runner.forward = forward = forward_class(runner.model)
    seen = []
    logits, decoder = forward.logits, forward.decoder
    forward.logits = lambda *a, **k: seen.append(logits(*a, **k).clone()) or seen[-1]
    forward.decoder = lambda *a, **k: seen.append(None) or decoder(*a, **k)
    vocab = model.config.vocab_size
    params = SamplingParams(max_new_tokens=12)
    tokens = []
    # six prompts together, then one of 150 tokens alone (its first steps sample nothing)
    for batch in (prompts(vocab), [torch.randint(3, vocab, (150,), generator=torch.Generator()).tolist()]):
        for i, p in enumerate(batch):
            engine.add(p, params, request=i)
        while engine.has_unfinished():
            tokens += [(s.request, s.output_token_ids) for s in engine.step().finished]
    engine.check_integrity()
    return seen, tokens


@pytest.mark.parametrize("family", STACKED)
def test_the_stack_computes_hfs_logits_bit_for_bit(family):
    stacked, stacked_tokens = recorded_run(family, DecoderStack)
    hf, hf_tokens = recorded_run(family, HFForward)
    assert None in stacked and any(x is not None for x in stacked)  # both of the stack's calls ran
    assert len(stacked) == len(hf)
    for ours, theirs in zip(stacked, hf):
        assert (ours is None) == (theirs is None)
        if ours is not None:
            assert torch.equal(ours, theirs)
    assert stacked_tokens == hf_tokens


@pytest.mark.parametrize(
    "family, why",
    [
        ("gemma", "GemmaModel.forward is not a form"),  # scales the embeddings
        ("cohere", "CohereForCausalLM.forward is not a form"),  # scales the logits
        ("mistral", "MistralModel.forward is not a form"),  # a form not read yet: HF's
    ],
)
def test_a_forward_that_does_more_keeps_hfs(family, why):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config(family, SUPPORTED[family][1]))
    assert why in decoder_stack.refusal(model)
    assert type(decoder_stack.forward_of(model)) is HFForward


def test_what_the_forms_do_not_show_keeps_hfs():
    from transformers import LlamaForCausalLM

    class Scaled(LlamaForCausalLM):  # one more statement: not the form
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    config = tiny_config("llama", {})
    assert decoder_stack.refusal(LlamaForCausalLM(config)) is None
    assert "Scaled.forward is not a form" in decoder_stack.refusal(Scaled(config))
    causal = tiny_config("llama", {})
    causal.is_causal = True  # the config-defaults decorator would pass it to every layer
    assert "is_causal" in decoder_stack.refusal(LlamaForCausalLM(causal))
    fewer = LlamaForCausalLM(config)
    fewer.config.num_hidden_layers = 1  # HF's forward would run the first layer alone
    assert "holds 2 layers, its config runs 1" in decoder_stack.refusal(fewer)


def test_a_hook_on_an_outer_module_sees_every_call(monkeypatch):
    model = build("llama", {}, "paged")
    engine = family_engine(model, "torch")
    assert type(engine.runner.forward) is DecoderStack
    inner_calls = []
    inner_forward = type(model.model).forward
    monkeypatch.setattr(
        type(model.model), "forward", lambda *a, **k: inner_calls.append(1) or inner_forward(*a, **k)
    )
    params = SamplingParams(max_new_tokens=4)

    def steps() -> int:
        engine.add(prompts(model.config.vocab_size)[1], params)
        n = 0
        while engine.has_unfinished():
            engine.step()
            n += 1
        return n

    assert steps() and not inner_calls  # the stack ran: HF's model forward was never called
    seen = {"outer": 0, "inner": 0}
    handles = [
        model.register_forward_hook(lambda *_: seen.update(outer=seen["outer"] + 1)),
        model.model.register_forward_pre_hook(lambda *_: seen.update(inner=seen["inner"] + 1)),
    ]
    n = steps()
    assert seen == {"outer": n, "inner": n} and len(inner_calls) == n
    for h in handles:
        h.remove()
    inner_calls.clear()
    assert steps() and not inner_calls
