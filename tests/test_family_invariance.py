"""Batch invariance over the architecture matrix: the shortest prompt run alone gives the tokens it gives beside
the longest one, on each CPU backend, every family (issue 32). A file of its own, so that `make test`'s two
workers (one file each at a time) share the matrix."""

from __future__ import annotations

import pytest
import torch
from helpers import run_engine
from model_families import SUPPORTED
from test_families import NEW_TOKENS, models, prompts

from batchrun.engine import SamplingParams


@pytest.mark.parametrize("attention", ["torch", "gather"])
@pytest.mark.parametrize("family", sorted(SUPPORTED))
def test_a_row_alone_equals_the_row_beside_a_long_batch_mate(family, attention):
    """Batch invariance: the shortest prompt run alone gives the tokens it gives beside the longest one (a
    feature computed from the batch, such as LongRoPE's factors, would break it)."""
    from batchrun.engine import Engine, EngineConfig, LoadedModel

    model, _ = models(family)
    short, long = prompts(model.config.vocab_size)[0], prompts(model.config.vocab_size)[-1]
    got = []
    for batch in ([short], [long, short]):
        config = EngineConfig(device="cpu", num_pages=256, attention=attention)
        engine = Engine(LoadedModel(model, max_model_len=512), config, torch.device("cpu"))
        seqs, _ = run_engine(engine, batch, SamplingParams(max_new_tokens=NEW_TOKENS))
        got.append(seqs[-1][0].output_token_ids)
    assert got[0] == got[1]
