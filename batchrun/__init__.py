"""batchrun: offline batch inference for LLMs on a paged KV cache."""

__version__ = "0.1.0"
