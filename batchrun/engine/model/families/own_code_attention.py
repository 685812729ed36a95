"""Attention computed in the model's own code is refused at load, naming the module that computes it.

Why: batchrun replaces transformers' attention function and nothing else, so a decoder whose attention module
multiplies queries by keys itself (Bloom, MPT, Falcon, XGLM, GPT-Neo, OpenAI GPT, GPT-NeoX-Japanese, CPM-Ant)
never hands batchrun its K/V. Without this rule such a model failed inside its own forward (MPT: its
`create_causal_mask` returns None under a custom attention function and its code calls `.to` on it) or was
refused only as "never called batchrun's attention", neither naming the construct.

Checks at load: the modules of the decoder (`get_decoder`: an image encoder keeps its own attention) whose class
name ends in `Attention` and whose modeling file never dispatches through transformers' attention interface
(`ALL_ATTENTION_FUNCTIONS`), but those a route of families.alibi_attention computes. Provides: `refusal`.
"""

from __future__ import annotations

import functools
import inspect
import sys

from batchrun.engine.model.families.adapter import FamilyAdapter
from batchrun.engine.model.families.alibi_attention import ROUTES
from batchrun.engine.model.structure import decoder_of

# what a modeling file names where its attention goes through transformers' attention interface
INTERFACE = "ALL_ATTENTION_FUNCTIONS"


class OwnCodeAttention(FamilyAdapter):
    name = "attention computed in the model's own code"

    def refusal(self, model) -> str | None:
        own = sorted(
            {
                f"{type(m).__name__} ({type(m).__module__.rsplit('.', 1)[-1]}.py)"
                for m in decoder_of(model).modules()
                if type(m).__name__.endswith("Attention")
                and type(m).__name__ not in ROUTES
                and not _dispatches(type(m).__module__)
            }
        )
        if not own:
            return None
        return (
            f"its attention is computed in the model's own code ({', '.join(own)}, which never calls "
            "transformers' attention interface), so batchrun cannot page it"
        )


@functools.cache
def _dispatches(module_name: str) -> bool:
    """Whether a modeling file names transformers' attention interface (read once per file)."""
    try:
        return INTERFACE in inspect.getsource(sys.modules[module_name])
    except (KeyError, OSError, TypeError):
        return True  # a module without source (built at run time): not judged here


ADAPTER = OwnCodeAttention()
