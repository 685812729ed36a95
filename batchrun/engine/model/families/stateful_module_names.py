"""Modules whose class says they keep a state per sequence: linear attention, convolutions, state-space mixers.

Why: such a module carries a state from one step to the next; batchrun keeps it in a state slot only where the
module keeps it through transformers' cache interface (or an adapter moves it, as RecurrentGemma's). One that
keeps it any other way would silently start afresh at every step, so the load refuses it (stateful_layers.
stateful_modules). The class name is read after the model's own prefix: Kimi Linear's `KimiLinearAttention` is
that family's attention, not linear attention.

Checks at load: module class names. Provides: `looks_stateful`.
"""

from __future__ import annotations

import re

from batchrun.engine.model.families.adapter import FamilyAdapter

STATEFUL_MODULE = re.compile(r"Mamba|DeltaNet|ShortConv|LinearAttention|Rwkv|RWKV|xLSTM|Recurrent")


class StatefulModuleNames(FamilyAdapter):
    name = "stateful modules by name"

    def looks_stateful(self, model, module) -> bool:
        prefix = re.sub(r"(For\w+|Model)$", "", type(model).__name__)
        return bool(STATEFUL_MODULE.search(type(module).__name__.removeprefix(prefix)))


ADAPTER = StatefulModuleNames()
