"""The architecture matrix on the Triton kernels (interpreted on the CPU here; they take head dims from 32):
two families in the default run (KV cache groups of different shapes under a window, a hybrid's stateful layers),
soft-capping, sinks, chunks and every hybrid behind `pytest -m triton_matrix`. A file of its own, so that
`make test`'s two workers (one file each at a time) share the matrix."""

from __future__ import annotations

import pytest
from model_families import HYBRID
from test_families import model_and_reference, run


# in the default run: KV cache groups of different shapes with a window, a hybrid's stateful layers, ALiBi (MPT's);
# soft-capping, sinks, chunks and Bloom's ALiBi (a minute or two each interpreted) behind the marker; the kernels' unit tests
# (tests/test_kernels.py) check every one of those features against the PyTorch reference in the default run
@pytest.mark.parametrize(
    "family",
    [
        "gemma4_text",
        "qwen3_5_text",
        "mpt",
        pytest.param("gemma2", marks=pytest.mark.triton_matrix),
        pytest.param("gpt_oss", marks=pytest.mark.triton_matrix),
        pytest.param("llama4_text", marks=pytest.mark.triton_matrix),
        pytest.param("bloom", marks=pytest.mark.triton_matrix),
    ],
)
def test_family_on_triton_equals_hf_generate(family):
    """The Triton kernels (interpreted on the CPU here; they take head dims from 32) with a window, ALiBi,
    soft-capping, sinks and chunks, beside a hybrid's stateful layers, and on KV cache groups of different shapes."""
    model, expected = model_and_reference(family, head_dim=32)
    got, _, engine = run(model, family, "triton")
    assert engine.attention.name == "triton"
    assert got == expected


@pytest.mark.triton_matrix
@pytest.mark.parametrize("family", sorted(HYBRID))
def test_every_hybrid_on_triton_equals_hf_generate(family):
    """The whole hybrid matrix on the Triton kernels (interpreted: minutes, so outside the default run). MLA
    hybrids (keys wider than values) are refused for Triton at load, naming the backends that run them."""
    from batchrun.errors import BadInput

    model, expected = model_and_reference(family, head_dim=32)
    try:
        got, _, engine = run(model, family, "triton")
    except BadInput as e:
        assert "(MLA); use attention: " in str(e) and getattr(model.config, "kv_lora_rank", None), e
        return
    assert engine.attention.name == "triton"
    assert got == expected
