"""batchrun's Triton kernels and their PyTorch references, installed as `batchrun_kernels`.

Not `kernels`, in the repository either: transformers probes for a package of that name (Hugging Face's
hub-kernels library, for MXFP4 and FP8 on a GPU) and, run from the checkout's root, would take this one for it.
"""

from .paged_attention import (
    QueryBlocks,
    paged_attention,
    plan_query_blocks,
    unsupported_reason,
    write_kv_cache,
)
from .reference import ref_paged_attention, ref_write_kv_cache

__all__ = [
    "QueryBlocks",
    "plan_query_blocks",
    "paged_attention",
    "write_kv_cache",
    "unsupported_reason",
    "ref_paged_attention",
    "ref_write_kv_cache",
]
