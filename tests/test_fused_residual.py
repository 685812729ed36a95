"""A decoder layer's residual adds in place (engine/model/ops/fused_residual.py, cpu_residual.cpp): each sum torch's own bit
for bit (fp32, bf16, fp16; the AVX-512 path and the generic loop), the first add with the fused RMSNorm as the two
calls compute it, and a model whose layers take them giving HF's logits bit for bit; layers of another structure,
hooked ones, and autograd left to HF's forward."""

from __future__ import annotations

import pytest
import torch
from model_families import tiny_model

from batchrun.engine.cpu_kernels import load
from batchrun.engine.model.ops import fused_elementwise, fused_residual

KERNEL = load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C++ compiler here")


def values(n: int, dtype, seed: int) -> torch.Tensor:
    """n values over many magnitudes, with the extremes: infinities, a NaN, the dtype's largest and tiniest."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.logspace(-6, 6, n)[torch.randperm(n, generator=gen)]
    info = torch.finfo(dtype)
    extremes = torch.tensor([float("inf"), -float("inf"), float("nan"), info.max, -info.max, info.tiny, 0.0])
    x[: len(extremes)] = extremes
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [7, 16 * 40 + 9])  # the generic loop alone; AVX-512 vectors and a generic tail
def test_residual_add_is_torchs_add_bit_for_bit(dtype, n):
    x, r = values(n, dtype, seed=n), values(n, dtype, seed=n + 1)
    want = r + x
    assert KERNEL.residual_add(x, r)
    assert torch.equal(x.isnan(), want.isnan()) and torch.equal(x[~x.isnan()], want[~want.isnan()])
    assert not KERNEL.residual_add(x[::2], r[::2])  # not contiguous: declined, nothing written
    assert not KERNEL.residual_add(x, x)  # itself
    assert not KERNEL.residual_add(x.long(), r.long())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [64, 24])  # the norm's AVX-512 path, its generic loop
def test_add_rms_norm_is_the_add_then_the_fused_norm(dtype, width):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(1, 13, width, generator=gen) * 3).to(dtype)
    r = (torch.randn(1, 13, width, generator=gen) * 5).to(dtype)
    hf = LlamaRMSNorm(width, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(torch.rand(width, generator=gen) + 0.5)
    norm = fused_elementwise.FusedRMSNorm(hf.to(dtype), KERNEL)
    sum_ = r + x
    want = norm(sum_)
    out = torch.empty_like(x)
    assert KERNEL.add_rms_norm(out, x, r, norm.weight, norm.variance_epsilon)
    assert torch.equal(x, sum_) and torch.equal(out, want)
    fp32 = [t.float() for t in (out, x, r, norm.weight)]
    assert not KERNEL.add_rms_norm(*fp32, 1e-6)  # fp32: never (the norm's sum would show)


def llama(dtype):
    model = tiny_model("llama", torch.float32)
    return model.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_models_layers_take_the_adds_and_its_logits_stay_bit_for_bit(dtype):
    model, reference = llama(dtype), llama(dtype)  # the same weights
    if dtype != torch.float32:  # the first add then rides with the fused norm
        assert fused_elementwise.fuse(model, dtype) == fused_elementwise.fuse(reference, dtype) > 0
    ids = torch.randint(3, 256, (1, 37), generator=torch.Generator().manual_seed(0))
    layers = model.config.num_hidden_layers
    assert fused_residual.install(model) == layers
    assert fused_residual.install(model) == 0  # installed once
    with torch.inference_mode():
        want = reference(ids).logits
        got = model(ids).logits
        assert torch.equal(got, want)
        assert torch.equal(model(ids[:, 5:9]).logits, reference(ids[:, 5:9]).logits)
    with torch.enable_grad():  # autograd: the class's own forward, gradients flow
        model(ids).logits.sum().backward()
    assert model.model.layers[0].mlp.down_proj.weight.grad is not None
    assert fused_residual.restore(model) == layers and "forward" not in model.model.layers[0].__dict__


def test_what_does_not_fit_keeps_its_forward():
    model = llama(torch.float32)
    model.model.layers[0].register_forward_hook(lambda *a: None)  # hooked: its calls must be seen
    model.model.layers[1].self_attn.o_proj = torch.nn.Sequential(model.model.layers[1].self_attn.o_proj)
    assert fused_residual.install(model) == 0  # the second's attention output is not a product's new tensor
    # a wrapper from outside transformers around a layer's or an attention's forward: that layer keeps its own
    # forward (the fused one would skip the layer's wrapper, or add into an output the attention's wrapper keeps)
    from test_fused_elementwise import foreign_wrapper

    for part in (lambda m: m.model.layers[0], lambda m: m.model.layers[0].self_attn):
        wrapped = llama(torch.float32)
        foreign_wrapper(part(wrapped))
        assert fused_residual.install(wrapped) == 1
        assert "forward" not in vars(wrapped.model.layers[0]) and "forward" in vars(wrapped.model.layers[1])
    gemma2 = tiny_model("gemma2", torch.float32)  # norms after the attention and the MLP: another forward
    assert fused_residual.install(gemma2) == 0
