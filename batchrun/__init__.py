"""batchrun: offline batch inference for LLMs on a paged KV cache.

    from batchrun import LLM, SamplingParams, run_job

The names are imported on first use, so `import batchrun` (and the commands that need no model) stay light.
"""

from .lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": ".llm",
    "RequestOutput": ".llm",
    "CompletionOutput": ".llm",
    "run_job": ".job",
    "SamplingParams": ".engine.config",
    "EngineConfig": ".engine.config",
    "BadInput": ".errors",
    "JobStopped": ".errors",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
