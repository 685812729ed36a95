"""The kinds of what a sequence holds beside its pages (cache_kind.CacheKind), in the order the engine makes them
and the coordinator calls them: a new kind is its module and its line here."""

from __future__ import annotations

from .state_kind import StateKind

KINDS = (StateKind,)
