"""The paged engine: sequence, block_manager, scheduler, kv_cache, model_runner, engine."""

from .engine import Engine, EngineConfig, StepResult
from .sequence import SamplingParams, Sequence

__all__ = ["Engine", "EngineConfig", "SamplingParams", "Sequence", "StepResult"]
