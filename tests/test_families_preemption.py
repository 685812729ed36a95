"""The architecture matrix under preemption: every supported family equal to HF `generate` token for token when
its sequences are preempted (swap or recompute, by family), on the torch backend. A file apart from
tests/test_families.py so that `make test`'s workers, which take a file each, share the matrix."""

from __future__ import annotations

import pytest
from model_families import SUPPORTED
from test_families import model_and_reference, run


@pytest.mark.parametrize("family", sorted(SUPPORTED))
def test_family_equals_hf_generate_under_preemption(family):
    model, expected = model_and_reference(family)
    got, steps, _ = run(
        model, family, "torch", full_pages=8, preemption="recompute" if len(family) % 2 else "swap"
    )
    assert any(s.plan.preempted for s in steps), "no sequence was preempted"
    assert got == expected, f"{family} differs under preemption"
