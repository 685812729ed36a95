"""A bf16/fp16 model's RMSNorms and SiLU-and-mul by the C++ kernels (engine/model/ops/fused_elementwise.py,
cpu_elementwise.cpp): each kernel against the HF module's own output (the AVX-512 path at widths that are a multiple
of 16, the generic one at 24; SiLU far left, where torch's e^-x overflows), the rewrite keyed on the module's
structure (Gemma's norm, a GELU MLP, a hooked norm left as HF wrote them; fp32's MLPs too, its norms bit-equal:
ExactRMSNorm), and on a few families of
different structure the fused model's logits against HF's own in bf16, and batchrun's LLM's prompt logprobs
against HF's bf16 forward. Every family's modules one by one: tests/test_fused_elementwise_families.py.

The kernels make HF's roundings to the model's dtype, but sum and exponentiate in fp32 in another order: each value
is held to at most one unit in its last place (two for SiLU-and-mul, whose two roundings can each go the other way),
nearly all of them bit-equal (a kernel that skipped one of HF's roundings would miss that), and a model's logits to
the bf16 tolerance of tests/test_cpu_kernels.py (1e-2 relative)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers import within_ulps
from model_families import LLAMA_FORM, TINY, perturb, tiny_model

from batchrun.engine.cpu_kernels import load
from batchrun.engine.model.ops import fused_elementwise
from batchrun.engine.model.ops.fused_elementwise import ExactRMSNorm, FusedRMSNorm, SiluAndMulMLP

KERNEL = load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C++ compiler here")
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}  # as tests/test_cpu_kernels.py


def rows(n: int, width: int, dtype, seed: int) -> torch.Tensor:
    """n rows of `width` values spread over several magnitudes, as columns of a wider buffer (a row stride)."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(n, width + 8, generator=gen) * torch.logspace(-2, 1, n)[:, None]
    return wide.to(dtype)[:, 3 : 3 + width]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
# AVX-512 (multiples of 16), the generic loops (24), both (600: a long row, its sum of squares in one order on
# every CPU; the generic loop's single running sum put a value two places from HF's, as on an AVX2 CPU at 576)
@pytest.mark.parametrize("width", [64, 576, 24, 600])
def test_rms_norm_equals_hf_modules_own_output(dtype, width):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(width, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(width, generator=torch.Generator().manual_seed(1)) * 0.5 + 1)
    hf = hf.to(dtype)
    x = rows(40, width, dtype, seed=width)[None]  # [1, T, H], as a decoder layer sees it
    want = hf(x)
    got = FusedRMSNorm(hf, KERNEL)(x)
    assert got.dtype == dtype and got.shape == want.shape
    assert within_ulps(got, want, 1)
    assert (got == want).float().mean().item() > 0.99  # HF's roundings, made: nearly every value bit-equal
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < TOL[dtype]
    alone = FusedRMSNorm(hf, KERNEL)(x[:, 7:9])  # a row's output is its own, whoever its batch-mates
    assert torch.equal(alone, got[:, 7:9])


@pytest.mark.parametrize("width", [64, 576, 24, 100])
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_an_fp32_norm_is_hfs_bit_for_bit(width, eps):
    """ExactRMSNorm (ATen's variance, then one C++ pass): every value HF's own, for rows of any width, one row
    or many, a row of wide magnitudes (the rsqrt's and the products' roundings all show), rows a stride apart
    (a column slice), and rows not one stride apart, which the kernel declines and the module copies."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(width)
    hf = LlamaRMSNorm(width, eps=eps)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(width, generator=gen) * 0.5 + 1)
    exact = ExactRMSNorm(hf, KERNEL)
    x = torch.randn(1, 300, width + 7, generator=gen) * torch.exp(torch.randn(1, 300, 1, generator=gen) * 4)
    for t in (x[:, :, :width], x[:, :1, 3 : 3 + width], x[:, :, :width].contiguous(), x[0, :50, :width]):
        got, want = exact(t), hf(t)
        assert got.shape == want.shape and got.dtype == torch.float32
        assert torch.equal(got, want)
    gaps = x[:, :, :width].reshape(2, 150, width)[:, :20]  # two runs of rows
    assert (
        KERNEL.rms_norm_scale(torch.empty(gaps.shape), gaps, gaps[..., :1].contiguous(), hf.weight, eps)
        is False
    )
    assert torch.equal(exact(gaps), hf(gaps))


def test_rows_that_are_not_one_stride_apart_are_made_so():
    """The kernels take [..., H] rows as they come where every row is one stride from the last (a layer's
    [1, T, H] hidden states, a column slice of a wider product) and decline other layouts, which the modules then
    make contiguous: both ways HF's values."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    dtype = torch.bfloat16
    hf = LlamaRMSNorm(64, eps=1e-5).to(dtype)
    x = rows(50, 64, dtype, seed=3).reshape(2, 25, 64)[:, :20]  # two runs of rows, a gap between them
    out = torch.empty(x.shape, dtype=dtype)
    assert KERNEL.rms_norm(out, x, hf.weight, 1e-5) is False
    assert KERNEL.silu_and_mul(out, x, x) is False
    one = torch.empty(x[:1].shape, dtype=dtype)
    assert KERNEL.rms_norm(one, x[:1], hf.weight, 1e-5) is True  # one run: taken as it is
    assert within_ulps(one, hf(x[:1]), 1)
    got = FusedRMSNorm(hf, KERNEL)(x)
    assert within_ulps(got, hf(x), 1) and got.shape == x.shape


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [128, 24])
def test_silu_and_mul_equals_hf_mlp(dtype, width):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    hf = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=width)).to(dtype).eval()
    x = rows(33, 32, dtype, seed=width)[None]
    with torch.no_grad():
        gate, up = hf.gate_proj(x), hf.up_proj(x)
        want_h = hf.act_fn(gate) * up
        h = torch.empty(want_h[0].shape, dtype=dtype)
        KERNEL.silu_and_mul(h, gate[0], up[0])
        assert within_ulps(h, want_h[0], 2)
        assert (h == want_h[0]).float().mean().item() > 0.99
        # the fused gate/up product's output taken whole (gate's columns then up's): the same values, bit for bit
        halves = torch.empty_like(h)
        assert KERNEL.silu_and_mul_halves(halves, torch.cat([gate[0], up[0]], -1))
        assert torch.equal(halves, h)
        fused = SiluAndMulMLP(hf, KERNEL)
        want, got = hf(x), fused(x)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < TOL[dtype]
    assert fused.gate_proj is hf.gate_proj and fused.down_proj is hf.down_proj


def test_an_mlp_whose_gate_and_up_are_one_product_reads_it_whole():
    """gate_proj and up_proj packed as one fused product (cpu_linear.py): the fused MLP computes that product
    once per call and takes no column views of it; the output equals HF's within bf16's ulps, a row's its own."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from batchrun.engine.model.ops.fused_linear import fuse_siblings

    dtype = torch.bfloat16
    torch.manual_seed(0)
    hf = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=48)).to(dtype).eval()
    x = rows(21, 32, dtype, seed=5)[None]
    with torch.inference_mode():
        want = hf(x)
        assert fuse_siblings(hf, lambda name, m: type(m) is torch.nn.Linear, lambda m: m) == 1
        fused = SiluAndMulMLP(hf, KERNEL)
        group = fused._joined[0]
        got = fused(x)
        assert group.products == 1 and group.calls == 2
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < TOL[dtype]
        assert torch.equal(fused(x[:, 4:6]), got[:, 4:6])
    unequal = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=48)).to(dtype)
    unequal.up_proj = torch.nn.Linear(32, 48, bias=False).to(dtype)  # not one product: each called by itself
    assert SiluAndMulMLP(unequal, KERNEL)._joined is None


@pytest.mark.parametrize("width", [64, 24])
def test_silu_and_mul_far_left_is_torchs(width):
    """Gates far below zero (a bf16 model with large activations has them): torch's SiLU is x / (1 + e^-x), -0
    once e^-x overflows fp32 and tiny just before; the kernel makes the same values there, not e^-87's (in fp16
    every such value is 0 on both sides)."""
    dtype = torch.bfloat16
    gate = torch.linspace(-120, -80, 9 * width).reshape(9, width).to(dtype)
    up = torch.linspace(-3, 5, 9 * width).reshape(9, width).to(dtype)
    want = torch.nn.functional.silu(gate) * up
    got = torch.empty_like(gate)
    KERNEL.silu_and_mul(got, gate, up)
    assert (want == 0).any() and (want != 0).any()  # both sides of the overflow
    assert within_ulps(got, want, 2)


def tiny(family: str, dtype, **overrides):
    import transformers

    config_cls, model_cls = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    }[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**TINY, **overrides})
    model = getattr(transformers, model_cls)(config).eval()
    perturb(model, seed=1)  # norm weights off 1
    return model.to(dtype)


def counts(model) -> tuple[int, int]:
    mods = list(model.modules())
    return sum(isinstance(m, FusedRMSNorm) for m in mods), sum(isinstance(m, SiluAndMulMLP) for m in mods)


# of different structure among the rewritten: Llama; Qwen3's q/k norms; Qwen2's window on some layers; DeepSeek-V3's
# dense first layer and shared expert beside its routed experts, under MLA (and, by forward alone, Bamba's MLPs
# beside Mamba 2 layers: through LLM it is the slowest by far)
END_TO_END = ["llama", "qwen3", "qwen2", "deepseek_v3"]


def llama_form(model, family: str) -> int:
    """How many of the model's modules are of its family's Llama-form classes (model_families.LLAMA_FORM)."""
    return sum(type(m).__name__ in LLAMA_FORM[family] for m in model.modules())


@pytest.mark.parametrize("family", [*END_TO_END, "bamba"])
def test_a_familys_norms_and_mlps_are_fused_and_logits_stay_within_bf16_tolerance(family):
    model = tiny_model(family, torch.bfloat16)
    reference = copy.deepcopy(model)
    ids = torch.randint(3, 256, (1, 45), generator=torch.Generator().manual_seed(0))  # past Qwen2's window
    fused = llama_form(model, family)
    assert fused and fused_elementwise.fuse(model, torch.bfloat16) == fused
    assert sum(counts(model)) == fused
    assert model.state_dict().keys() == reference.state_dict().keys()  # parameters under their names
    with torch.inference_mode():
        got, want = model(ids).logits.float(), reference(ids).logits.float()
        assert not torch.equal(got, torch.zeros_like(got))
        assert ((got - want).norm() / want.norm()).item() < TOL[torch.bfloat16], family
        assert fused_elementwise.restore(model) == fused
        assert torch.equal(model(ids).logits, reference(ids).logits)  # HF's modules back, bit for bit


@pytest.mark.parametrize("family", END_TO_END)
def test_a_bf16_llm_of_the_family_scores_a_prompt_as_hf_within_bf16_tolerance(family, tmp_path, model_dir):
    """batchrun's LLM in bf16 (packed products, paged attention, the fused modules) on the family's tiny model:
    its prompt logprobs against HF's own bf16 forward of the same weights."""
    import shutil

    from batchrun import LLM, SamplingParams

    tiny_model(family, torch.float32).save_pretrained(tmp_path)
    for f in Path(model_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, tmp_path / f.name)
    reference = tiny_model(family, torch.bfloat16)
    llm = LLM(str(tmp_path), dtype="bfloat16", device="cpu", num_pages=64)
    assert llm.rewrites["fused_elementwise"] == llama_form(reference, family) > 0
    prompt = torch.randint(3, 256, (45,), generator=torch.Generator().manual_seed(0)).tolist()
    out = llm.generate([prompt], SamplingParams(max_new_tokens=0, prompt_logprobs=True), use_tqdm=False)[0]
    got = torch.tensor(out.prompt_logprobs[1:])
    with torch.inference_mode():
        logprobs = reference(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    want = logprobs.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert ((got - want).norm() / want.norm()).item() < TOL[torch.bfloat16]


def test_what_does_not_fit_stays_as_hf_wrote_it():
    fp32 = tiny("llama", torch.float32)  # the norms alone, bit-equal; the MLPs stay HF's
    assert fused_elementwise.fuse(fp32, torch.float32) == 2 * TINY["num_hidden_layers"] + 1
    assert counts(fp32) == (0, 0) and type(fp32.model.norm) is ExactRMSNorm
    gemma = tiny("gemma", torch.bfloat16)  # (1 + weight), in fp32 throughout: not the kernel's computation
    fused_elementwise.fuse(gemma, torch.bfloat16)
    assert counts(gemma)[0] == 0
    gelu = tiny("llama", torch.bfloat16, hidden_act="gelu")
    fused_elementwise.fuse(gelu, torch.bfloat16)
    assert counts(gelu) == (2 * TINY["num_hidden_layers"] + 1, 0)  # its norms only
    hooked = tiny("llama", torch.bfloat16)
    hooked.model.norm.register_forward_hook(lambda m, args, out: None)
    fused_elementwise.fuse(hooked, torch.bfloat16)
    assert type(hooked.model.norm).__name__ == "LlamaRMSNorm"
    assert counts(hooked)[0] == 2 * TINY["num_hidden_layers"]


def foreign_wrapper(module: torch.nn.Module):
    """Give `module` a class whose forward a `functools.wraps` wrapper from outside transformers doubles (a
    profiler's or a patch's wrapper): `inspect` reads the wrapped forward's source through it."""
    import functools

    inner = type(module).forward

    @functools.wraps(inner)
    def doubled(self, *args, **kwargs):
        return 2 * inner(self, *args, **kwargs)

    module.__class__ = type("Wrapped" + type(module).__name__, (type(module),), {"forward": doubled})


def test_a_forward_wrapped_by_code_outside_transformers_stays_as_written():
    """A norm or an MLP whose forward such a wrapper wraps stays the model's own (the wrapper runs); transformers'
    own wrappers (a decoder layer's, an attention's) are read through."""
    model = tiny("llama", torch.bfloat16)
    norm, mlp = model.model.norm, model.model.layers[0].mlp
    foreign_wrapper(norm)
    foreign_wrapper(mlp)
    fused_elementwise.fuse(model, torch.bfloat16)
    assert model.model.norm is norm and model.model.layers[0].mlp is mlp
    assert counts(model) == (2 * TINY["num_hidden_layers"], TINY["num_hidden_layers"] - 1)
    x = rows(4, TINY["hidden_size"], torch.bfloat16, seed=5)
    assert torch.equal(norm(x), 2 * type(norm).__mro__[1].forward(norm, x))
    layer = type(model.model.layers[0])  # Llama's layer forward: under transformers' deprecation wrapper
    assert hasattr(layer.forward, "__wrapped__") and fused_elementwise.wrapped_by_transformers_alone(
        layer.forward
    )


def test_a_bf16_llm_runs_fused_and_each_rows_tokens_are_its_own():
    """LLM fuses a bf16 model's 61 norms and 30 MLPs (SmolLM2-135M), an fp32 one's norms alone; with them, a row's
    tokens do not depend on its batch-mates (a prompt alone and among others, in one packed step)."""
    from batchrun import LLM, SamplingParams

    llm = LLM(device="cpu", dtype="bfloat16", num_pages=64)
    assert llm.rewrites["fused_elementwise"] == 2 * 30 + 1 + 30
    params = SamplingParams(max_new_tokens=8)
    prompts = ["The capital of France is", "List three colours:", "Once upon a time, in a small village,"]
    alone = llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].token_ids
    among = llm.generate(prompts[1:2] + prompts[:1] + prompts[2:], params, use_tqdm=False)
    assert among[1].outputs[0].token_ids == alone
    fp32 = LLM(device="cpu", dtype="float32", num_pages=16)
    assert fp32.rewrites["fused_elementwise"] == 2 * 30 + 1  # the norms alone
