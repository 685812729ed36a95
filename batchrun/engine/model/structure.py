"""Where a Hugging Face model keeps what the engine reads of it: its language model's config and its decoder
stack. Every part of the engine that reads a model (its probe, sizing, the rewrites, the runner) asks here, so a
family that keeps them elsewhere is one change."""

from __future__ import annotations

import torch


def text_config(cfg):
    """The language model's config (a vision-language model's `text_config`; the config itself otherwise)."""
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The model's decoder stack: what transformers' `get_decoder` finds, except where that lookup (by the
    attribute name `decoder` first) finds the LM head (ModernBERT-decoder's): the base model then."""
    if not hasattr(model, "get_decoder"):
        return model
    decoder = model.get_decoder()
    return model.base_model if decoder is model.get_output_embeddings() else decoder
