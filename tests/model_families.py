"""The architecture matrix: tiny random-weight models made from each family's own `transformers` config (no
download), with each family's distinctive features on. The README's table of supported families is generated
from these lists (tests/test_families.py checks that it is).

`SUPPORTED`: equal to HF `generate` token for token (tests/test_families.py). `REFUSED`: refused at load with a
reason (the text the error must contain). A window or chunk of 32 tokens is far shorter than the test's
sequences (prompts of 4-75 tokens and 24 new ones), so every masked path is exercised.
"""

from __future__ import annotations

WINDOW = 32

# every family: hidden 64, 4 heads of 16 over 2 KV heads, vocabulary 256; `layers` is the number of layers
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.3,  # at the default 0.02 several families repeat one token, which tests little
)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)

# family -> (what it shows, config overrides)
SUPPORTED: dict[str, tuple[str, dict]] = {
    "llama": ("full attention", {}),
    "qwen2": (
        "sliding window on some layers",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
    "qwen3": ("q/k norms", {}),
    "qwen2_moe": (
        "mixture of experts, shared expert",
        dict(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64
        ),
    ),
    "qwen3_moe": ("mixture of experts", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "mixtral": ("mixture of experts", dict(MOE, sliding_window=None)),
    "mistral": ("sliding window", dict(sliding_window=WINDOW)),
    "gemma": ("GeGLU, scaled embeddings", {}),
    "gemma2": (
        "sliding window, logit soft-capping",
        dict(sliding_window=WINDOW, num_hidden_layers=4, attn_logit_softcapping=5.0),
    ),
    "gemma3_text": ("sliding window on 5 of 6 layers", dict(sliding_window=WINDOW, num_hidden_layers=6)),
    "cohere2": ("sliding window on 3 of 4 layers", dict(sliding_window=WINDOW, num_hidden_layers=4)),
    "starcoder2": ("sliding window, biases", dict(sliding_window=WINDOW)),
    "exaone4": ("sliding window on 3 of 4 layers", dict(sliding_window=WINDOW, num_hidden_layers=4)),
    "olmo3": ("sliding window on 3 of 4 layers", dict(sliding_window=WINDOW, num_hidden_layers=4)),
    "gpt_oss": ("attention sinks, sliding window on every other layer", dict(MOE, sliding_window=WINDOW)),
    "llama4_text": (
        "chunked attention, query temperature on NoRoPE layers",
        dict(
            attention_chunk_size=WINDOW,
            num_hidden_layers=4,
            intermediate_size_mlp=128,
            num_local_experts=2,
            no_rope_layers=[1, 1, 1, 0],
            floor_scale=8,
            attn_scale=0.5,
        ),
    ),
    "deepseek_v3": (
        "MLA: K head dim 48, V head dim 32",
        dict(
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            moe_intermediate_size=64,
        ),
    ),
    "granite": ("scaled residuals and logits", {}),
    "phi": ("partial rotary, parallel blocks", {}),
    "phi3": ("fused projections", dict(sliding_window=None)),
    "gpt_neox": ("parallel residual", {}),
    "gpt2": ("learned positions", {}),
    "olmo2": ("post-norms", {}),
    "cohere": ("parallel blocks", {}),
    "glm": ("partial rotary", {}),
    "smollm3": ("NoPE layers", {}),
    "exaone": ("full attention", {}),
}

REFUSED: dict[str, tuple[str, dict]] = {
    "falcon": ("does not go through transformers' attention interface", dict(_drop=["head_dim"])),
    "stablelm": ("does not pass batchrun's step metadata", {}),
    "qwen3_next": (
        "linear_attention",
        dict(
            num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),
    ),
    "lfm2": ("conv", dict(layer_types=["conv", "full_attention"])),
    "falcon_h1": ("hybrid", {}),
}


def tiny_config(family: str, overrides: dict):
    from transformers import AutoConfig

    kw = dict(TINY)
    kw.update(overrides)
    for key in kw.pop("_drop", []):  # keys a family's config does not take
        del kw[key]
    return AutoConfig.for_model(family, **kw)


def perturb(model, seed: int) -> None:
    """`from_config` leaves biases at 0 and norm weights at 1 (and sinks as initialised): change them, or the
    test would not see a backend that ignores them."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            is_norm = "norm" in type(module).__name__.lower()
            for name, p in module.named_parameters(recurse=False):
                if name == "bias" or name == "sinks" or is_norm:
                    p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.5)
