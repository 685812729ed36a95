"""The paged engine: sequence, block_manager, scheduler, kv_cache, model_runner, attention, sampler, engine.

Names are imported on first use: the job-file parser needs `config` alone, without torch.
"""

from ..lazy import lazy_exports

_EXPORTS = {
    "Engine": ".engine",
    "StepResult": ".engine",
    "LoadedModel": ".loading",
    "EngineConfig": ".config",
    "SamplingParams": ".config",
    "MemorySnapshot": ".memory",
    "Sequence": ".sequence",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)
