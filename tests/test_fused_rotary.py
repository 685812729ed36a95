"""HF's `apply_rotary_pos_emb` as one C++ call (cpu_elementwise.cpp's `rotary_embedding`, engine/model/ops/fused_rotary.py):
the kernel against HF's own functions bit for bit in fp32, bf16 and fp16 (head dims 32/64/128 on the AVX-512
path, 24 on the generic one; GQA; q and k as the attention module makes them, views of one packed product with
its heads transposed; both unsqueeze dims; partial rotary), the calls it declines, which forms are taken, and
that the fused function is HF's own outside batchrun's forward. Every family's model: tests/
test_fused_rotary_families.py."""

from __future__ import annotations

import copy

import pytest
import torch

from batchrun.engine.cpu_kernels import load
from batchrun.engine.model.ops import fused_rotary
from batchrun.engine.model.prepare import Preparation, prepare_model

KERNEL = load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C++ compiler here")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def packed_qk(tokens: int, heads: int, kv_heads: int, dim: int, dtype, unsqueeze_dim: int = 1, seed: int = 0):
    """q [1, H, T, D] and k [1, Hkv, T, D] (unsqueeze_dim 1; [1, T, H, D] for 2) as views of one packed
    q/k/v product: each token's row as wide as all three, heads split, then transposed. Values over several
    magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    width = (heads + 2 * kv_heads) * dim
    qkv = torch.randn(1, tokens, width, generator=gen) * torch.logspace(-1, 2, tokens)[:, None]
    qkv = qkv.to(dtype)
    q = qkv[..., : heads * dim].view(1, tokens, heads, dim)
    k = qkv[..., heads * dim : (heads + kv_heads) * dim].view(1, tokens, kv_heads, dim)
    return (q.transpose(1, 2), k.transpose(1, 2)) if unsqueeze_dim == 1 else (q, k)


def cos_sin(tokens: int, rot: int, dtype, start: int = 0):
    """[1, T, rot] as Llama's rotary module makes them: positions times inverse frequencies, the halves
    repeated, cos and sin in fp32, then cast to the model's dtype."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    freqs = torch.arange(start, start + tokens, dtype=torch.float32)[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [32, 64, 128, 24])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("tokens", [1, 37])
def test_kernel_equals_hfs_apply_rotary_pos_emb_bit_for_bit(dtype, dim, unsqueeze_dim, tokens):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = packed_qk(tokens, 6, 2, dim, dtype, unsqueeze_dim, seed=dim + tokens)
    cos, sin = cos_sin(tokens, dim, dtype, start=1000)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
    got_q, got_k = KERNEL.rotary_embedding(q, k, cos, sin, unsqueeze_dim, False)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert layout(got_q) == layout(want_q) and layout(got_k) == layout(want_k)  # HF's layout too


def layout(t: torch.Tensor) -> list[int]:
    """The strides of the dims that have any (a dim of size 1 has none to keep)."""
    return [s for s, n in zip(t.stride(), t.shape, strict=True) if n > 1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("module", ["gpt_neox", "phi3"])
def test_partial_rotary_equals_hfs(dtype, module):
    """The two partial-rotary forms: cos narrower than the head, the rest of each head passed through."""
    import importlib

    hf = importlib.import_module(f"transformers.models.{module}.modeling_{module}").apply_rotary_pos_emb
    q, k = packed_qk(19, 4, 2, 64, dtype)
    for rot in (16, 32, 64):  # the generic loops, the AVX-512 path, the whole head
        cos, sin = cos_sin(19, rot, dtype, start=7)
        want = hf(q, k, cos, sin)
        got = KERNEL.rotary_embedding(q, k, cos, sin, 1, True)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), rot
    assert KERNEL.rotary_embedding(q, k, cos[..., :16], sin[..., :16], 1, False) == []  # not Llama's form


def test_bit_equality_sees_another_rounding():
    """The comparison can fail: the same rotation rounded once (what a fused multiply-add of the second
    product into the first would come closer to) differs from HF's in fp32."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, rotate_half

    q, k = packed_qk(37, 6, 2, 64, torch.float32)
    cos, sin = cos_sin(37, 64, torch.float32, start=1000)
    want, _ = apply_rotary_pos_emb(q, k, cos, sin)
    c, s = cos[:, None].double(), sin[:, None].double()
    once = (q.double() * c + rotate_half(q.double()) * s).float()
    assert not torch.equal(once, want)
    assert torch.equal(KERNEL.rotary_embedding(q, k, cos, sin, 1, False)[0], want)


def test_the_kernel_declines_what_it_does_not_compute():
    q, k = packed_qk(5, 4, 2, 32, torch.bfloat16)
    cos, sin = cos_sin(5, 32, torch.bfloat16)
    assert KERNEL.rotary_embedding(q, k, cos.float(), sin.float(), 1, False) == []  # HF promotes to fp32
    assert KERNEL.rotary_embedding(q, k, cos[:, :4], sin[:, :4], 1, False) == []  # other token count
    assert KERNEL.rotary_embedding(q, k, cos, sin, 0, False) == []
    assert KERNEL.rotary_embedding(q[0], k[0], cos, sin, 1, False) == []  # 3-D
    assert KERNEL.rotary_embedding(q.double(), k.double(), cos.double(), sin.double(), 1, False) == []
    wide = torch.cat((cos, cos), -1)
    assert KERNEL.rotary_embedding(q, k, wide, wide, 1, True) == []  # cos wider than the head
    assert KERNEL.rotary_embedding(q, k, cos, sin, 1, False) != []


@pytest.mark.parametrize(
    ("module", "form"),
    [
        ("llama", False),
        ("qwen2", False),
        ("olmo2", False),  # casts to q's dtype: nothing where every input has it
        ("gpt_neox", True),
        ("phi3", True),
        ("cohere", None),  # interleaved halves, in fp32
        ("glm", None),  # interleaved
        ("gemma4", None),  # one tensor at a time
        ("gpt_oss", None),  # its own halves' arithmetic
        ("ernie4_5", None),
    ],
)
def test_forms_read_from_the_functions(module, form):
    import importlib

    fn = importlib.import_module(f"transformers.models.{module}.modeling_{module}").apply_rotary_pos_emb
    assert fused_rotary.form_of(getattr(fn, "hf", fn)) is form


def test_the_fused_function_is_hfs_outside_batchrun_s_forward(monkeypatch):
    """Installed, the modeling module's function calls HF's with the same arguments outside `applied()` and
    the kernel inside; leaving `applied()` on an exception restores HF's."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2))
    assert fused_rotary.install(model) == 2  # its two attention modules
    fused = modeling_llama.apply_rotary_pos_emb
    assert isinstance(fused, fused_rotary.FusedRotary)  # the modeling module's own global
    calls = []
    real = KERNEL.rotary_embedding
    monkeypatch.setattr(KERNEL, "rotary_embedding", lambda *a: calls.append(1) or real(*a))
    q, k = packed_qk(9, 4, 4, 16, torch.float32)
    cos, sin = cos_sin(9, 16, torch.float32)
    want = fused.hf(q, k, cos, sin)
    assert all(torch.equal(g, w) for g, w in zip(fused(q, k, cos, sin), want, strict=True)) and not calls
    with fused_rotary.applied():
        got = fused(q, k, cos, sin)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)) and len(calls) == 1
    with pytest.raises(RuntimeError), fused_rotary.applied():
        raise RuntimeError
    fused(q, k, cos, sin)
    assert len(calls) == 1
    assert fused_rotary.install(model) == 2  # once per module: a second model finds it installed
    assert modeling_llama.apply_rotary_pos_emb is fused


# Llama's form; partial rotary; per-sequence rope (LongRoPE, dynamic NTK: other cos/sin, the same application)
ENGINE_FAMILIES = ["llama", "gpt_neox", "phi3:longrope", "llama:dynamic_ntk"]


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_an_engine_with_the_kernel_equals_hf_generate(family, monkeypatch):
    """batchrun's engine in fp32 (prompts in chunks beside decodes: tests/test_families.py's run) takes the
    kernel for every rotary call of its forward, and its tokens equal HF generate's."""
    import test_families as families

    model, expected = families.model_and_reference(family)
    model = copy.deepcopy(
        model
    )  # prepared as LLM prepares it (its weights unpacked): the cached one left alone
    prepared = prepare_model(model, Preparation(torch.device("cpu"), torch.float32, pack_weights=False))
    assert prepared["fused_rotary"] == model.config.num_hidden_layers
    calls = []
    real = KERNEL.rotary_embedding
    monkeypatch.setattr(KERNEL, "rotary_embedding", lambda *a: calls.append(bool(out := real(*a))) or out)
    got, steps, engine = families.run(model, family, "torch")
    assert calls == [True] * len(steps) * model.config.num_hidden_layers
    assert got == expected
