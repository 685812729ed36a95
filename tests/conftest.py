"""Shared fixtures. TRITON_INTERPRET must be set before anything imports triton (transformers does), so the
Triton kernels run on CPU tensors here; the GPU check (bench/gpu_check.sh) sets BATCHRUN_TRITON_GPU=1."""

import os

if os.environ.get("BATCHRUN_TRITON_GPU") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on two cores: one thread each, and for the batchrun processes they start
    # (more threads than cores make OpenMP's threads wait on each other)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from batchrun.model_loader import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def tok_model(model_dir):
    """The embedded default model with batchrun's paged attention (fp32, CPU)."""
    from batchrun.engine.model.loading import load_model

    return load_model(model_dir, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="session")
def chat_prompts(tok_model):
    """Token ids of 16 chat prompts of about 20 to 400 tokens."""
    from helpers import chat_ids

    tok, _ = tok_model
    topics = [
        "the sea",
        "paging in operating systems",
        "bread",
        "the moon",
        "jazz",
        "volcanoes",
        "chess",
        "rain",
        "bicycles",
        "owls",
        "glass",
        "trains",
        "coffee",
        "maps",
        "bees",
        "clocks",
    ]
    prompts = []
    for i, t in enumerate(topics):
        filler = " ".join(f"Fact {k}: {t} matters for reason number {k}." for k in range(i * 3))
        prompts.append(f"{filler}\nWrite two sentences about {t}.")
    return [chat_ids(tok, p) for p in prompts]
