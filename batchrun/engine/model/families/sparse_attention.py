"""Sparse attention is refused: DeepSeek V3.2 and V4, GLM-MoE-DSA, Qwen 4's indexed layers.

Why: an indexer picks each query's keys by a score over every earlier token, or a compressor pools old keys into
entries, and keeps its own cache of them; batchrun's paged attention does not compute that (it would need the
indexer's keys paged beside K/V and a top-k gather in every backend), so such a model is refused at load.

Checks at load: module classes named like an indexer or compressor, layer types naming index, compress or sparse
layers. Provides: `refusal`.
"""

from __future__ import annotations

import re

from batchrun.engine.model.families.adapter import FamilyAdapter

SPARSE_MODULE = re.compile(r"Indexer|Compressor")
SPARSE_LAYER_TYPE = re.compile(r"index|compress|sparse")


class SparseAttention(FamilyAdapter):
    name = "sparse attention"

    def refusal(self, model) -> str | None:
        sparse = sorted({type(m).__name__ for m in model.modules() if SPARSE_MODULE.search(type(m).__name__)})
        layer_types = getattr(model.config.get_text_config(), "layer_types", None) or []
        sparse += sorted({t for t in layer_types if SPARSE_LAYER_TYPE.search(t)})
        if not sparse:
            return None
        return (
            f"sparse attention ({', '.join(sparse)}): an indexer or compressor chooses or pools each query's keys "
            "from a score over all earlier tokens and keeps its own cache of them, which batchrun's paged "
            "attention does not compute (it would need the indexer's keys paged beside K/V and a top-k gather "
            "in every backend)"
        )


ADAPTER = SparseAttention()
