"""engine/model/ops/fused_elementwise.py across the family matrix (tests/model_families.py's SUPPORTED) in bf16: each
family's tiny model runs one forward under HF's own modules, hooks recording every module's inputs and output;
then `fuse`, and each fused module on the same recorded inputs against what HF's module computed, to the
tolerance tests/test_fused_elementwise.py holds the kernels to (one unit in the last place for a norm, two for
SiLU-and-mul, read at the input of the MLP's down_proj, which is the same module on both sides).

Which modules are rewritten is checked against tests/model_families.py's `LLAMA_FORM`, written from reading each
family's classes in transformers (their `forward`, activation and norm arithmetic), not from fused_elementwise's
predicate: a family silently skipped, or one wrongly rewritten (Gemma's `1 + weight` norm, OLMo's and GPT-OSS's
`(weight * x)` cast after the product, Llama 4's `activation_fn`, a GELU or ReLU-squared MLP, a gated norm),
fails. The image families' whole models too (a vision tower's norms are rewritten where they are Llama's). A few
families end to end: tests/test_fused_elementwise.py."""

from __future__ import annotations

import pytest
import test_image_families as images
import torch
from helpers import check_fused, fused_modules, record_calls
from model_families import LLAMA_FORM, SUPPORTED, tiny_model

from batchrun.engine.cpu_kernels import load
from batchrun.engine.model.ops import fused_elementwise
from batchrun.engine.model.ops.fused_elementwise import FusedRMSNorm

pytestmark = pytest.mark.skipif(load() is None, reason="no C++ compiler here")


def prompt(config) -> torch.Tensor:
    return torch.randint(3, min(config.vocab_size, 256), (1, 21), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", sorted(SUPPORTED))
def test_each_familys_llama_form_modules_are_fused_within_one_ulp(family):
    assert family in LLAMA_FORM, f"{family}: say which of its classes are Llama's RMSNorm / gated MLP"
    model = tiny_model(family, torch.bfloat16)
    llama_form = sorted(type(m).__name__ for m in model.modules() if type(m).__name__ in LLAMA_FORM[family])
    if not llama_form:  # nothing to compute (Inkling 2's bf16 router cannot run under HF's code)
        assert fused_elementwise.fuse(model, torch.bfloat16) == 0
        return
    calls = record_calls(model, prompt(model.config))
    assert fused_elementwise.fuse(model, torch.bfloat16) == len(llama_form)
    assert sorted(type(m._hf[0]).__name__ for m in fused_modules(model)) == llama_form
    equal, total = map(sum, zip(*(check_fused(m, calls) for m in fused_modules(model)), strict=True))
    assert equal / total > 0.99  # HF's roundings made: nearly every value bit-equal


def test_the_matrix_sees_a_wrong_rewrite(monkeypatch):
    """OLMo 2's norm (the weight product in fp32, one rounding after it) taken for Llama's: within one unit of
    Llama's arithmetic everywhere, so the ulp bound alone passes it; the count from LLAMA_FORM and the share of
    bit-equal values do not."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    olmo_norm = fused_elementwise.forward_of(Olmo2RMSNorm(8))
    monkeypatch.setattr(fused_elementwise, "KNOWN_NORMS", fused_elementwise.KNOWN_NORMS | {olmo_norm})
    model = tiny_model("olmo2", torch.bfloat16)
    calls = record_calls(model, prompt(model.config))
    mlps = sum(type(m).__name__ in LLAMA_FORM["olmo2"] for m in model.modules())
    assert fused_elementwise.fuse(model, torch.bfloat16) > mlps
    norms = [m for m in fused_modules(model) if isinstance(m, FusedRMSNorm)]
    equal, total = map(sum, zip(*(check_fused(m, calls) for m in norms), strict=True))
    assert equal / total < 0.99


def qwen_vision(model):
    c = model.model.visual.config
    torch.manual_seed(0)
    pixels = torch.randn(16, c.in_channels * c.temporal_patch_size * c.patch_size**2, dtype=torch.bfloat16)
    return lambda: model.model.visual(pixels, grid_thw=torch.tensor([[1, 4, 4]]))


def pixtral_vision(model):
    torch.manual_seed(0)
    pixels, sizes = torch.randn(1, 3, 64, 64, dtype=torch.bfloat16), torch.tensor([[64, 64]])
    tower, projector = model.model.vision_tower, model.model.multi_modal_projector
    return lambda: projector(tower(pixels, image_sizes=sizes).last_hidden_state[0], sizes)


# a call of the vision tower (and projector) on random pixels, where the family has modules to fuse there
VISION = {"qwen2_5_vl": qwen_vision, "mistral3": pixtral_vision}


@pytest.mark.parametrize("family", images.FAMILIES)
def test_a_vision_language_models_llama_form_modules_are_fused_within_one_ulp(family, tmp_path, model_dir):
    """The image families' whole models (tests/test_image_families.py's tiny ones), as LLM fuses them: the text
    model's modules on a text prompt, the vision tower's and projector's on random pixels."""
    from transformers import AutoModelForImageTextToText

    makers = dict(gemma3=images.make_gemma3, gemma4=images.make_gemma4, mistral3=images.make_mistral3)
    makers.update(smolvlm=images.make_smolvlm, inkling2=images.make_inkling2)
    makers.get(family, lambda target, tok: images.make_qwen_vl(family, target, tok))(tmp_path, model_dir)
    model = AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    llama_form = sorted(type(m).__name__ for m in model.modules() if type(m).__name__ in LLAMA_FORM[family])
    if not llama_form:
        assert fused_elementwise.fuse(model, torch.bfloat16) == 0
        return
    vision = VISION[family](model) if family in VISION else lambda: None
    calls = record_calls(model, prompt(model.config.get_text_config()), before=vision)
    assert fused_elementwise.fuse(model, torch.bfloat16) == len(llama_form)
    assert sorted(type(m._hf[0]).__name__ for m in fused_modules(model)) == llama_form
    equal, total = map(sum, zip(*(check_fused(m, calls) for m in fused_modules(model)), strict=True))
    assert equal / total > 0.99
