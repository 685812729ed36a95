"""The attention backends' registry: each backend's name (its value of `engine.attention`) and the class that is
it, in the order `auto` tries them. The one place a backend is named and ordered: attention/backends/__init__.py
loads the classes from here into `BACKENDS`, giving each its name, and the job file's check of
`engine.attention` (config.py) reads the names.

A module of its own, outside the attention package and importing nothing: config.py reads it before any model
is loaded and without torch (importing anything under engine/attention imports torch), and the modules the
backends import (page_pool, sequence) import config, so config importing the backends would be a circle.
"""

from __future__ import annotations

# name -> the class's module under engine/attention/backends and its name there
REGISTRY: dict[str, str] = {
    "triton": "triton_paged.TritonAttention",  # CUDA: the paged Triton kernels
    "torch": "cpu_paged.TorchAttention",  # CPU: batchrun's C++ paged decode and bf16 prompts, else SDPA
    "gather": "gather.GatherAttention",  # anywhere: plain PyTorch, pages gathered per step for SDPA
}
