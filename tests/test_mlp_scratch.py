"""The fused MLPs' shared activation buffer (fused_elementwise.Scratch) on its own: a model's SiLU-gated MLPs,
packed and fused as the engine loads them (cpu_linear.pack_linear_layers, fused_elementwise.fuse), write their
`silu(gate) * up` into one tensor, which each MLP's down_proj alone reads before the next MLP runs. What that
promises, checked on three MLPs of two widths called in turn at token counts that grow, stay and shrink:

- every MLP shares the one buffer, and each call's output is bit for bit the output of the same module given a
  fresh activation tensor (no Scratch), and within bf16's tolerance of HF's own module (fp32 models are never
  fused: tests/test_fused_elementwise.py);
- an output handed out is a tensor of its own: every earlier output still holds its values after the later
  calls have rewritten the buffer, at the same shape and at others;
- the buffer is kept at the last call's shape and replaced at another (a decode step's layers reuse it);
- what the buffer relies on holds: a down_proj that could keep its input (a hooked one) is given a fresh
  tensor, and so is a call under autograd."""

from __future__ import annotations

import copy

import pytest
import torch

from batchrun.engine.cpu_kernels import load
from batchrun.engine.model.ops import fused_elementwise
from batchrun.engine.model.ops.cpu_linear import available, pack_linear_layers
from batchrun.engine.model.ops.fused_elementwise import Scratch, SiluAndMulMLP

KERNEL = load()
DTYPE = torch.bfloat16
# the buffer is the packed gate/up product's: where oneDNN cannot reorder bf16 (an AVX2 CPU) nothing is packed
pytestmark = pytest.mark.skipif(
    KERNEL is None or not available(DTYPE), reason="no C++ compiler here, or no bf16 packing on this CPU"
)
TOL = 1e-2  # tests/test_fused_elementwise.py's bf16 bound (relative, in norm) against HF's module


def mlps(widths: list[int]) -> tuple[torch.nn.ModuleList, torch.nn.ModuleList]:
    """HF's LlamaMLPs of hidden size 32 and these intermediate widths (bf16, weights of their own), and a copy
    packed and fused as a loaded model's are."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    hf = torch.nn.ModuleList([LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=w)) for w in widths]).to(
        DTYPE
    )
    fused = copy.deepcopy(hf)
    pack_linear_layers(fused)
    assert fused_elementwise.fuse(fused, DTYPE) == len(widths)
    return hf, fused


def fresh(mlp: SiluAndMulMLP, x: torch.Tensor) -> torch.Tensor:
    """The module's output with a new activation tensor (no Scratch)."""
    kept, mlp._scratch = mlp._scratch, None
    try:
        return mlp(x)
    finally:
        mlp._scratch = kept


def test_mlps_sharing_the_buffer_give_each_its_own_output():
    hf, fused = mlps([48, 48, 64])
    scratch = fused[0]._scratch
    assert isinstance(scratch, Scratch) and all(m._scratch is scratch for m in fused)
    gen = torch.Generator().manual_seed(1)
    # (MLP, tokens): the same shape twice by two MLPs, then more tokens, fewer, another width, back again
    calls = [(0, 6), (1, 6), (0, 11), (1, 3), (2, 3), (0, 3), (2, 11), (1, 6), (0, 1)]
    outputs = []
    with torch.inference_mode():
        for i, tokens in calls:
            x = torch.randn(1, tokens, 32, generator=gen).to(DTYPE)
            got = fused[i](x)
            width = fused[i].down_proj.in_features
            assert scratch.tensor.shape == (1, tokens, width)  # the buffer at this call's shape
            assert got.untyped_storage().data_ptr() != scratch.tensor.untyped_storage().data_ptr()
            assert torch.equal(got, fresh(fused[i], x))
            want = hf[i](x)
            assert ((got.float() - want.float()).norm() / want.float().norm()).item() < TOL
            outputs.append((got, got.clone()))
        # every output handed out still holds what it held when it was handed out
        for n, (got, then) in enumerate(outputs):
            assert torch.equal(got, then), f"call {n}'s output was overwritten"
        # the same shape again: the buffer is reused, not replaced
        kept = scratch.tensor
        fused[1](torch.randn(1, 1, 32, generator=gen).to(DTYPE))
        assert scratch.tensor is kept


def test_a_down_proj_that_could_keep_its_input_and_autograd_get_fresh_tensors():
    hf, fused = mlps([48, 48])
    seen = []
    fused[1].down_proj.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    hooked = SiluAndMulMLP(
        fused[1]._hf[0], KERNEL, fused[0]._scratch
    )  # made as fuse makes it, after the hook
    assert hooked._scratch is None
    gen = torch.Generator().manual_seed(2)
    x, y = (torch.randn(1, 5, 32, generator=gen).to(DTYPE) for _ in range(2))
    with torch.inference_mode():
        first = hooked(x)
        kept = seen[0].clone()
        fused[0](y)  # the shared buffer rewritten at the hooked call's shape
        assert torch.equal(seen[0], kept)  # what the hook kept is its own
        assert torch.equal(hooked(x), first)
    scratch = fused[0]._scratch
    with torch.no_grad():
        fused[0](x)
    before = scratch.tensor  # at x's shape
    longer = torch.randn(1, 7, 32, generator=gen).to(DTYPE)
    with torch.enable_grad():
        graded = fused[0](longer)
    assert scratch.tensor is before  # autograd's call took a fresh tensor, not the buffer at its shape
    with torch.no_grad():
        assert torch.equal(graded, fused[0](longer))
