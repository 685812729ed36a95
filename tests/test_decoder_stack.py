"""batchrun's own outer forward (engine/model/ops/decoder_stack.py) against HF's: the same logits, bit for bit, at every step
of one workload (chunked prompts, steps where nothing samples, decodes); the families whose outer forwards do
more than the known forms keep HF's; a hook on either outer module still sees every call."""

import pytest
import torch
from model_families import SUPPORTED, perturb, tiny_config
from test_families import build, family_engine, prompts

from batchrun.engine import SamplingParams
from batchrun.engine.model.ops import decoder_stack
from batchrun.engine.model.ops.decoder_stack import DecoderStack, HFForward

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
def test_the_stack_computes_hfs_logits_bit_for_bit(family, monkeypatch):
    fell_back = []  # a DecoderStack step that ran HF's forward after all (its per-step checks said no)
    for name in ("logits", "decoder"):
        hf = getattr(HFForward, name)

        def counted(self, *args, hf=hf, **kwargs):
            if type(self) is DecoderStack:
                fell_back.append(1)
            return hf(self, *args, **kwargs)

        monkeypatch.setattr(HFForward, name, counted)
    stacked, stacked_tokens = recorded_run(family, DecoderStack)
    assert not fell_back
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
        ("mistral", "MistralModel.forward is not a form"),  # not more, but a form not read here yet
    ],
)
def test_a_forward_not_of_the_forms_keeps_hfs(family, why):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config(family, SUPPORTED[family][1]))
    assert why in decoder_stack.refusal(model)
    assert type(decoder_stack.forward_of(model)) is HFForward


def test_what_the_forms_do_not_show_keeps_hfs():
    import functools

    from transformers import LlamaForCausalLM

    class Scaled(LlamaForCausalLM):  # one more statement: not the form
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    config = tiny_config("llama", {})
    config._attn_implementation = "batchrun"
    assert decoder_stack.refusal(LlamaForCausalLM(config)) is None
    assert "Scaled.forward is not a form" in decoder_stack.refusal(Scaled(config))
    hf_attention = tiny_config("llama", {})  # transformers' own attention builds masks of its own
    assert "batchrun's attention" in decoder_stack.refusal(LlamaForCausalLM(hf_attention))
    causal = tiny_config("llama", {})
    causal._attn_implementation, causal.is_causal = "batchrun", True  # passed on to every layer by HF
    assert "is_causal" in decoder_stack.refusal(LlamaForCausalLM(causal))
    fewer = LlamaForCausalLM(config)
    fewer.config.num_hidden_layers = 1  # HF's forward would run the first layer alone
    assert "holds 2 layers, its config runs 1" in decoder_stack.refusal(fewer)

    class Wrapped(LlamaForCausalLM):  # the same source, read through a wrapper that is not transformers'
        @functools.wraps(LlamaForCausalLM.forward)
        def forward(self, *args, **kwargs):
            return LlamaForCausalLM.forward(self, *args, **kwargs)

    assert "Wrapped.forward is not a form" in decoder_stack.refusal(Wrapped(config))


def counted_steps(engine, prompt) -> int:
    engine.add(prompt, SamplingParams(max_new_tokens=4))
    n = 0
    while engine.has_unfinished():
        engine.step()
        n += 1
    return n


def test_a_hook_patch_or_config_change_after_the_load_turns_a_step_back_to_hfs(monkeypatch):
    """Each step asks whether what the load checked still holds: a hook on either outer module sees every call
    (each step of this prompt samples, so the outer model is called every step), a class forward replaced
    after the load runs, a config change is honoured; with them gone the stack runs again."""
    model = build("llama", {}, "paged")
    engine = family_engine(model, "torch")
    assert type(engine.runner.forward) is DecoderStack
    prompt = prompts(model.config.vocab_size)[1]
    hf_calls = []
    hf_logits = HFForward.logits
    monkeypatch.setattr(HFForward, "logits", lambda *a, **k: hf_calls.append(1) or hf_logits(*a, **k))
    assert counted_steps(engine, prompt) and not hf_calls  # the stack ran, never HF's forward
    seen = {"outer": 0, "inner": 0}
    handles = [
        model.register_forward_hook(lambda *_: seen.update(outer=seen["outer"] + 1)),
        model.model.register_forward_pre_hook(lambda *_: seen.update(inner=seen["inner"] + 1)),
    ]
    n = counted_steps(engine, prompt)
    assert seen == {"outer": n, "inner": n} and len(hf_calls) == n
    for h in handles:
        h.remove()
    hf_calls.clear()
    assert counted_steps(engine, prompt) and not hf_calls
    patched = []
    inner_forward = type(model.model).forward
    monkeypatch.setattr(
        type(model.model), "forward", lambda *a, **k: patched.append(1) or inner_forward(*a, **k)
    )
    n = counted_steps(engine, prompt)
    assert len(patched) == len(hf_calls) == n
    monkeypatch.setattr(type(model.model), "forward", inner_forward)
    hf_calls.clear()
    monkeypatch.setattr(model.config, "is_causal", True, raising=False)
    assert counted_steps(engine, prompt) == len(hf_calls)
    monkeypatch.delattr(model.config, "is_causal")
    hf_calls.clear()
    assert counted_steps(engine, prompt) and not hf_calls
