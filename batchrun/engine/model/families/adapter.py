"""What a family adapter is: one rule batchrun follows for particular model families, declared in one place.

An adapter says what it applies to (`model_types`, the configs' `model_type` values; empty where the rule finds
what it concerns in the model itself: a module class, a config key) and which of the hooks below it provides.
The engine never tests a family's name: it asks the registry (families/__init__.py), which asks every adapter
that applies. A hook an adapter leaves alone answers "nothing to do here", so a family no adapter covers runs on
transformers' code as it is, or is refused at load with the reason, never computed by another family's rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

IMAGE_POSITIONS = "positions"  # the image tokens' positions (the model's own get_rope_index)
IMAGE_ATTENTION = "attention"  # the image tokens' attention (token types that open an image to itself)


class FamilyAdapter:
    """One family rule. Subclasses set `name` and `model_types` and override the hooks their rule needs."""

    name: str = ""  # the family and its quirk, as messages name it
    model_types: frozenset[str] = frozenset()  # empty: asked of every model (the rule looks for itself)

    def applies(self, config) -> bool:
        """Whether this rule is asked about a model of this config (its top-level one)."""
        return not self.model_types or getattr(config, "model_type", None) in self.model_types

    # ---- at load: the config and the modules, before and around the probe (architecture.py) ----
    def looks_stateful(self, model, module) -> bool:
        """The module's class says it keeps a state per sequence (refused unless batchrun can keep it)."""
        return False

    def refusal(self, model) -> str | None:
        """Why batchrun cannot compute this model exactly (the load refuses it, naming the reason), or None."""
        return None

    def query_scale_fixes(self, model) -> dict[int, Any]:
        """Layer -> a fix of the query scale its attention applied by the packed row's index (QueryScaleFix)."""
        return {}

    def adapt_modules(self, model) -> None:
        """Install what this rule changes on the model's own module instances (idempotent)."""

    def keeps_own_states(self, module) -> bool:
        """The module keeps its states in attributes of its own, which `stateful_forward` moves in and out."""
        return False

    def stateful_forward(self, module) -> Callable | None:
        """For a module of `keeps_own_states`: a forward (hidden, cache, **kwargs) over transformers' cache
        layer of its sequences' slots, wrapping the module's own."""
        return None

    def cache_methods(self) -> dict[str, Callable]:
        """Methods the state slots' cache adds for a family's own names of transformers' cache interface."""
        return {}

    def cache_interface_calls(self) -> tuple[str, ...]:
        """Method names whose call in a module's source shows it keeps its state through that cache."""
        return ()

    def video_stand_in(self, config) -> dict:
        """Attributes the stand-in for a processor's video processor answers (loading.NoVideo)."""
        return {}

    # ---- images (multimodal.py, engine.py) ----
    # which part of its families' image tokens the adapter writes down (IMAGE_POSITIONS, IMAGE_ATTENTION): a
    # family of its `model_types` takes images; another family with that part of its own is refused images
    image_rule: str | None = None

    def image_positions(self, model) -> Any:
        """The model's own positions of image tokens (an object with `prompt_positions` and `step_positions`,
        as MRope), or None: 1-D positions."""
        return None

    def image_blocks(self, model) -> Any:
        """The model's rule for one image's tokens seeing each other (ImageBlocks), or None: causal."""
        return None

    def extra_feature_streams(self, model) -> int:
        """Feature rows per image token that the image encoder gives beyond the embeddings' own."""
        return 0

    def feature_streams(self, output) -> list[list]:
        """The extra streams of `get_image_features`'s output, each a list of per-image tensors."""
        return []

    def with_feature_streams(self, output, streams: list) -> None:
        """Hand the extra streams of a step's image tokens back on the output given to the model's forward."""
