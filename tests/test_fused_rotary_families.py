"""engine/model/ops/fused_rotary.py across the family matrix (tests/model_families.py's SUPPORTED): each family's tiny
model, in fp32 and in bf16, gives bit-equal logits with its rotary taken by the C++ kernel (inside
`fused_rotary.applied()`, as the model runner's forward) and by HF's own function, and the kernel is called
exactly for the families of `ROTARY_FORM` (in bf16, less those of `ROTARY_COS_IN_FP32`), written from reading each family's modeling file, not from
fused_rotary's predicate: a family silently left on HF's function, or one whose rotary the kernel wrongly took,
fails. batchrun's engine on a few families against HF generate: tests/test_fused_rotary.py's last tests and
tests/test_families.py."""

from __future__ import annotations

import pytest
import torch
from model_families import ROTARY_COS_IN_FP32, ROTARY_FORM, SUPPORTED, tiny_model

from batchrun.engine.cpu_kernels import load
from batchrun.engine.model.ops import fused_rotary

KERNEL = load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C++ compiler here")


@pytest.mark.parametrize("family", sorted(SUPPORTED))
def test_each_familys_rotary_is_fused_where_it_is_hfs_form_and_logits_stay_bit_equal(family, monkeypatch):
    calls = {torch.float32: [], torch.bfloat16: []}  # per dtype: whether the kernel took each call
    real = KERNEL.rotary_embedding

    def counted(q, *args):
        out = real(q, *args)
        calls[q.dtype].append(bool(out))
        return out

    monkeypatch.setattr(KERNEL, "rotary_embedding", counted)
    model = tiny_model(family, torch.float32)
    fused_rotary.install(model)
    vocab = min(model.config.vocab_size, 256)
    ids = torch.randint(3, vocab, (1, 21), generator=torch.Generator().manual_seed(0))
    # Inkling 2's bf16 router cannot run under HF's code
    for dtype in (torch.float32,) if family == "inkling2_text" else (torch.float32, torch.bfloat16):
        model.to(dtype)
        with torch.inference_mode():
            want = model(ids).logits
            with fused_rotary.applied():
                got = model(ids).logits
        assert torch.equal(got, want), (family, dtype)
    takes = {torch.float32: family in ROTARY_FORM, torch.bfloat16: family in ROTARY_FORM - ROTARY_COS_IN_FP32}
    for dtype, taken in calls.items():  # every call or none: a family's calls are all of one form
        assert taken == [takes[dtype]] * len(taken) and (taken or not takes[dtype]), (family, dtype, taken)
