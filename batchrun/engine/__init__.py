"""The paged engine: sequence, block_manager, scheduler, kv_cache, model_runner, attention, sampler, engine.

Names are imported on first use: the job-file parser needs `config` alone, without torch.
"""

from batchrun.lazy import lazy_exports

_EXPORTS = {
    "Engine": ".engine",
    "StepResult": ".engine",
    "LoadedModel": ".model.loading",
    "EngineConfig": ".config",
    "SamplingParams": ".config",
    "MemorySnapshot": ".core.memory",
    "Sequence": ".core.sequence",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)
