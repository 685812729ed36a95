"""A BERT-style block's GELU and residual add as post-ops of its packed products (engine/model/ops/fused_encoder.py): each
fused module against HF's own module on the same packed weights (fp32: within an fp32 unit in the last place,
nearly all bit-equal; bf16: within the bf16 tolerance), a whole tiny BERT's token states against HF's, and the
rewrite keyed on structure (a GELU oneDNN does not compute as torch does, an unpacked or hooked layer, a model in
training mode computing HF's statements). tests/test_embed.py holds the pooling runner's vectors, fused, to
sentence-transformers'."""

from __future__ import annotations

import pytest
import torch
from helpers import within_ulps

from batchrun.engine.model.ops import cpu_linear, fused_encoder
from batchrun.engine.model.ops.cpu_linear import pack_linear_layers
from batchrun.engine.model.ops.fused_encoder import DenseAddNorm, DenseGELU

pytestmark = pytest.mark.skipif(not cpu_linear.available(torch.float32), reason="oneDNN packing unavailable")
BF16 = cpu_linear.available(torch.bfloat16)
TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}  # relative norm of the difference


def tiny_bert(hidden_act: str = "gelu", dtype=torch.float32):
    """A two-layer BERT with random (non-zero) biases and LayerNorm parameters, in eval mode."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=120,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=160,
        hidden_act=hidden_act,
        max_position_embeddings=64,
    )
    model = BertModel(config, add_pooling_layer=False).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.to(dtype)


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    err = (got.float() - want.float()).norm() / want.float().norm()
    return err.item() < TOL[want.dtype]


IDS = torch.randint(5, 120, (1, 37), generator=torch.Generator().manual_seed(1))
DTYPES = [torch.float32] + ([torch.bfloat16] if BF16 else [])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_modules_compute_hf_modules_own_output(dtype):
    model = tiny_bert(dtype=dtype)
    pack_linear_layers(model)
    layer = model.encoder.layer[0]
    hf = {
        "intermediate": layer.intermediate,
        "output": layer.output,
        "attention.output": layer.attention.output,
    }
    assert fused_encoder.fuse(model) == 3 * model.config.num_hidden_layers
    assert isinstance(layer.intermediate, DenseGELU)
    assert isinstance(layer.output, DenseAddNorm) and isinstance(layer.attention.output, DenseAddNorm)
    assert not layer.output.training and not layer.attention.output.training  # as the model was: eval
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(1, 37, 64, generator=gen).to(dtype)
    wide = torch.randn(1, 37, 160, generator=gen).to(dtype)
    with torch.inference_mode():
        pairs = [
            (layer.intermediate(h), hf["intermediate"](h)),
            (layer.output(wide, h), hf["output"](wide, h)),
            (layer.attention.output(h * 0.5, h), hf["attention.output"](h * 0.5, h)),
        ]
    for got, want in pairs:
        assert got.dtype == dtype and got.shape == want.shape
        assert close(got, want)
        if (
            dtype == torch.float32
        ):  # each value within an fp32 unit, nearly all equal (not all: fp32 jobs don't fuse)
            assert within_ulps(got, want, 1)
            assert (got == want).float().mean().item() > 0.99
        else:  # one rounding fewer: the post-op ran (HF's statements would give HF's values)
            assert not torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_bert_token_states_equal_hf(dtype):
    model = tiny_bert(dtype=dtype)
    with torch.inference_mode():
        want = model(IDS).last_hidden_state
    pack_linear_layers(model)
    with torch.inference_mode():
        packed = model(IDS).last_hidden_state
    assert fused_encoder.fuse(model) == 6
    with torch.inference_mode():
        got = model(IDS).last_hidden_state
    assert close(got, want)
    if (
        dtype == torch.float32
    ):  # within an fp32 unit of the unfused packed model (pooling/runner.py fuses no fp32 model)
        assert (got - packed).abs().max().item() < 1e-6
    assert fused_encoder.restore(model) == 6
    with torch.inference_mode():
        assert torch.equal(model(IDS).last_hidden_state, packed)


def test_what_does_not_fit_stays_as_hf_wrote_it():
    """A GELU other than torch's erf one (HF's Python formula, torch's tanh approximation, whose post-op is not
    bit-equal in fp32), an unpacked product, a hooked module: left alone."""
    for act in ("gelu_new", "gelu_pytorch_tanh"):
        model = tiny_bert(act)
        pack_linear_layers(model)
        assert fused_encoder.fuse(model) == 4  # the outputs only
        assert not any(isinstance(m, DenseGELU) for m in model.modules())

    model = tiny_bert()
    assert fused_encoder.fuse(model) == 0  # nothing packed: nothing carries a post-op

    model = tiny_bert()
    pack_linear_layers(model)
    model.encoder.layer[0].output.register_forward_hook(lambda *a: None)
    model.encoder.layer[1].intermediate.dense.register_forward_pre_hook(lambda *a: None)
    assert fused_encoder.fuse(model) == 4
    assert not isinstance(model.encoder.layer[0].output, DenseAddNorm)
    assert not isinstance(model.encoder.layer[1].intermediate, DenseGELU)


def test_training_mode_runs_hf_code():
    """In training mode dropout drops: the fused output computes HF's statements, dropout included."""
    model = tiny_bert()
    pack_linear_layers(model)
    fused_encoder.fuse(model)
    output = model.encoder.layer[0].output
    hf = output._hf[0]
    model.train()
    h, wide = torch.randn(1, 5, 64), torch.randn(1, 5, 160)
    torch.manual_seed(3)
    with torch.no_grad():
        got = output(wide, h)
    hf.train()
    torch.manual_seed(3)
    with torch.no_grad():
        want = hf(wide, h)
    assert torch.equal(got, want)
    model.eval()
    with torch.no_grad():
        assert not torch.equal(got, output(wide, h))  # dropout dropped something
