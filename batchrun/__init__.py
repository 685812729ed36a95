"""batchrun: offline batch inference for LLMs on a paged KV cache.

    from batchrun import LLM, SamplingParams, run_job

The names are imported on first use, so `import batchrun` (and the commands that need no model) stay light.
"""

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": ".llm",
    "RequestOutput": ".llm",
    "CompletionOutput": ".llm",
    "run_job": ".llm",
    "SamplingParams": ".engine.config",
    "EngineConfig": ".engine.config",
    "BadInput": ".errors",
    "JobStopped": ".errors",
}

__all__ = sorted(_EXPORTS)


def lazy_exports(package: str, exports: dict[str, str]):
    """A module `__getattr__` that imports `exports[name]` (relative to `package`) on first use of `name`."""

    def __getattr__(name: str):
        if name in exports:
            import importlib

            return getattr(importlib.import_module(exports[name], package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


__getattr__ = lazy_exports(__name__, _EXPORTS)
