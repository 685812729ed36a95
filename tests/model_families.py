"""The architecture matrix: tiny random-weight models made from each family's own `transformers` config (no
download), with each family's distinctive features on. docs/models.md's table of supported families is generated
from these lists (tests/test_families.py checks that it is).

`SUPPORTED`: equal to HF `generate` token for token (tests/test_families.py). `REFUSED`: refused at load with a
reason (the text the error must contain). A window or chunk of 32 tokens is far shorter than the test's
sequences (prompts of 4-75 tokens and 24 new ones), so every masked path is exercised.
"""

from __future__ import annotations

WINDOW = 32
# LongRoPE's and dynamic NTK's original context: the prompts and generations run on both sides of it
ORIGINAL_CONTEXT = 32

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
# a vision-language model's vision tower (tests/test_images.py, test_image_families.py)
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def tiny_text(vocab_size: int, **overrides) -> dict:
    """A vision-language model's text config: TINY with the tokenizer's vocabulary, room for prompts with
    images, and its own token ids left to the family."""
    text = {k: v for k, v in TINY.items() if not k.endswith("token_id")}
    text.update(vocab_size=vocab_size, max_position_embeddings=2048, **overrides)
    return text


MOE = dict(num_local_experts=4, num_experts_per_tok=2)
# ALiBi's slopes, computed in the model's own code and routed through the paged attention (families.alibi_attention)
ALIBI = "ALiBi computed in the model's own code"

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
    "bloom": (ALIBI, {}),
    "mpt": (
        f"{ALIBI}, clipped q/k/v, its own softmax scale",
        dict(attn_config=dict(clip_qkv=0.8, softmax_scale=0.5)),
    ),
    "gemma": ("GeGLU, scaled embeddings", {}),
    "gemma2": (
        "sliding window, logit soft-capping",
        dict(sliding_window=WINDOW, num_hidden_layers=4, attn_logit_softcapping=5.0),
    ),
    "gemma3_text": ("sliding window on 5 of 6 layers", dict(sliding_window=WINDOW, num_hidden_layers=6)),
    "gemma4_text": (
        "full-attention layers of other head dims and KV heads, K = V, KV-shared layers, per-layer inputs",
        dict(
            sliding_window=WINDOW,
            num_hidden_layers=8,
            global_head_dim=32,
            num_global_key_value_heads=2,
            attention_k_eq_v=True,
            num_kv_shared_layers=2,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=256,
        ),
    ),
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
    "deepseek_v2": (
        "MLA: K head dim 48, V head dim 32 (DeepSeek-V2; Kimi-K2 is DeepSeek-V3's architecture)",
        dict(
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
    ),
    "phimoe": (
        "mixture of experts, sliding window in the mask alone (its attention call passes none)",
        dict(MOE, sliding_window=WINDOW),
    ),
    "modernbert-decoder": (
        "sliding window on 1 of 2 layers, an LM head named `decoder` (transformers' `get_decoder` finds it)",
        dict(
            local_attention=2 * WINDOW,
            cls_token_id=1,
            sep_token_id=2,
            _drop=["num_key_value_heads", "head_dim"],
        ),
    ),
    "granite": ("scaled residuals and logits", {}),
    "phi": ("partial rotary, parallel blocks", {}),
    "phi3": ("fused projections", dict(sliding_window=None)),
    # Phi-3.5-mini / Phi-4-mini: LongRoPE past an original context of 32, its factors per sequence
    "phi3:longrope": (
        "LongRoPE: short factors to 32 tokens, long past them, cache computed again at the switch",
        dict(
            sliding_window=None,
            original_max_position_embeddings=ORIGINAL_CONTEXT,
            rope_parameters=dict(
                rope_type="longrope",
                short_factor=[1.0 + i / 8 for i in range(8)],  # one per rotary frequency (head_dim 16)
                long_factor=[4.0 + i for i in range(8)],
                original_max_position_embeddings=ORIGINAL_CONTEXT,
                rope_theta=10000.0,
            ),
        ),
    ),
    "llama:dynamic_ntk": (
        "dynamic NTK scaling past 32 tokens, frequencies per sequence",
        dict(
            max_position_embeddings=ORIGINAL_CONTEXT,
            rope_parameters=dict(rope_type="dynamic", factor=4.0, rope_theta=10000.0),
        ),
    ),
    "gpt_neox": ("parallel residual", dict(_drop=["num_key_value_heads"])),  # no GQA: heads = KV heads
    "gpt2": ("learned positions", dict(_drop=["num_key_value_heads"])),
    "olmo2": ("post-norms", {}),
    "cohere": ("parallel blocks", {}),
    "glm": ("partial rotary", {}),
    "smollm3": ("NoPE layers", {}),
    "exaone": ("full attention", {}),
    "hunyuan_v1_moe": (
        "mixture of experts whose router reads its linear's weight",
        dict(num_experts=4, moe_topk=2, moe_intermediate_size=32),
    ),
    "longcat_flash": (
        "two MLA sublayers per decoder layer",
        dict(
            num_layers=2,
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=32,
            n_routed_experts=4,
            moe_topk=2,
            expert_ffn_hidden_size=32,
            ffn_hidden_size=64,
        ),
    ),
}

# hybrids: linear-attention, Mamba or short-convolution layers (a state slot per sequence) beside attention
LINEAR = dict(
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16
)
MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16)
THREE_LINEAR_ONE_FULL = ["linear_attention"] * 3 + ["full_attention"]
MLA = dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=32)
HYBRID: dict[str, tuple[str, dict]] = {
    "qwen3_5_text": (
        "hybrid: 3 Gated DeltaNet : 1 gated attention",
        dict(LINEAR, num_hidden_layers=4, layer_types=THREE_LINEAR_ONE_FULL),
    ),
    "qwen3_5_moe_text": (
        "hybrid: Gated DeltaNet, mixture of experts",
        dict(
            LINEAR,
            num_hidden_layers=4,
            layer_types=THREE_LINEAR_ONE_FULL,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),
    ),
    "qwen3_next": (
        "hybrid: Gated DeltaNet, mixture of experts",
        dict(
            num_hidden_layers=4,
            layer_types=THREE_LINEAR_ONE_FULL,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),
    ),
    "olmo_hybrid": ("hybrid: Gated DeltaNet : attention", {}),
    "kimi_linear": (
        "hybrid: Kimi Delta Attention : MLA",
        dict(
            MLA,
            num_hidden_layers=4,
            linear_attn_config=dict(
                full_attn_layers=[4], kda_layers=[1, 2, 3], head_dim=16, num_heads=4, short_conv_kernel_size=4
            ),
            v_head_dim=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
        ),
    ),
    "bailing_hybrid": (
        "hybrid: linear attention : MLA",
        dict(
            MLA,
            num_hidden_layers=4,
            layer_group_size=4,
            v_head_dim=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
        ),
    ),
    "nemotron_h": (
        "hybrid: Mamba 2, attention, MoE and MLP layers",
        dict(
            num_hidden_layers=4,
            layer_types=["linear_attention", "moe", "full_attention", "mlp"],
            mamba_num_heads=4,
            mamba_head_dim=16,
            ssm_state_size=16,
            n_groups=1,
            chunk_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=32,
        ),
    ),
    "granitemoehybrid": (
        "hybrid: Mamba 2 : attention, mixture of experts (Granite 4)",
        dict(
            MAMBA,
            num_hidden_layers=4,
            layer_types=THREE_LINEAR_ONE_FULL,
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=64,
        ),
    ),
    "bamba": ("hybrid: Mamba 2 : attention", dict(MAMBA, num_hidden_layers=4, attn_layer_indices=[3])),
    "falcon_h1": (
        "hybrid: Mamba 2 beside attention in every layer",
        dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16),
    ),
    "lfm2": ("hybrid: short convolution : attention", dict(layer_types=["conv", "full_attention"])),
    "lfm3": ("hybrid: short convolution : attention", dict(layer_types=["conv", "full_attention"])),
    "minimax": (
        "hybrid: lightning attention (its own cache methods) : attention",
        dict(layer_types=["linear_attention", "full_attention"]),
    ),
    "zamba2": (
        "hybrid: Mamba 2, two shared attention blocks called by alternate layers",
        dict(
            num_hidden_layers=4,
            layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
            mamba_d_state=16,
            mamba_headdim=16,
            n_mamba_heads=8,
            use_mem_rope=True,
            head_dim=32,  # its attention reads the hidden state beside the embeddings: 2 x 64 over 4 heads
            mamba_ngroups=1,
            chunk_size=16,
            num_mem_blocks=2,
        ),
    ),
    "jamba": (
        "hybrid: Mamba : attention, whole prompts (its scan takes no initial state)",
        dict(num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=3, mamba_d_state=16, num_experts=1),
    ),
    "inkling2_text": (
        "hybrid: short convolutions on K, V and each sublayer's output, a relative position bias from the hidden "
        "states, per-token sinks, attention over earlier layers' blocks",
        dict(
            num_hidden_layers=3,
            layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
            swa_num_attention_heads=4,
            swa_num_key_value_heads=1,
            swa_head_dim=16,
            head_dim=32,
            sliding_window_size=WINDOW,
            rel_extent=24,
            d_rel=8,
            log_scaling_n_floor=16,
            n_layers_per_attn_res_block=2,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            unpadded_vocab_size=256,
            _drop=["intermediate_size"],
        ),
    ),
    "zaya": (
        "hybrid: q/k convolved and half of v from the previous token (states through the cache interface, the "
        "module returning q, k and v), sliding window on 1 of 2 layers",
        dict(
            layer_types=["hybrid", "hybrid_sliding"],
            sliding_window=WINDOW,
            num_experts=4,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            router_hidden_size=32,
        ),
    ),
    "recurrent_gemma": (
        "hybrid: RG-LRU recurrent blocks (states in module attributes) : sliding attention, whole prompts",
        dict(num_hidden_layers=3, block_types=["recurrent", "recurrent", "attention"], lru_width=64),
    ),
}
SUPPORTED.update(HYBRID)
# hybrids whose stateful layers' prompt form does not continue a state: each prompt runs whole, nothing shared
# (Jamba's scan takes no initial state; RecurrentGemma's prompt form restarts its convolution)
WHOLE_PROMPTS = {"jamba", "recurrent_gemma"}

# family -> its classes whose forward is Llama's RMSNorm / SiLU-gated MLP statement for statement (engine/
# fused_elementwise.py rewrites those in bf16/fp16; tests/test_fused_elementwise_families.py), from reading them. Not there:
# LayerNorms (Cohere, GPT-2, GPT-NeoX, Phi, StarCoder 2), (1 + weight) norms (Gemma 1-3, Qwen 3.5, Qwen3-Next,
# RecurrentGemma), norms cast after the weight product (OLMo 2/3/hybrid, GPT-OSS, NemotronH, Inkling 2),
# Llama 4's `_norm(x).type_as(x) * weight`, the gated norms of the hybrids, fused-expert tensors (the MoE
# `*Experts` modules), gate_up_proj MLPs (Phi-3, GLM, GraniteMoeHybrid, Zamba 2), Falcon-H1's multipliers,
# LFM's w1/w2/w3, GELU (Gemma, RecurrentGemma) and ReLU-squared (NemotronH) MLPs
LLAMA_FORM: dict[str, tuple[str, ...]] = {
    "llama": ("LlamaRMSNorm", "LlamaMLP"),
    "llama:dynamic_ntk": ("LlamaRMSNorm", "LlamaMLP"),
    "exaone": ("LlamaRMSNorm", "LlamaMLP"),  # transformers builds EXAONE from Llama's classes
    "qwen2": ("Qwen2RMSNorm", "Qwen2MLP"),
    "qwen3": ("Qwen3RMSNorm", "Qwen3MLP"),  # q/k norms too, over head_dim
    "qwen2_moe": ("Qwen2MoeRMSNorm", "Qwen2MoeMLP"),  # the shared expert
    "qwen3_moe": ("Qwen3MoeRMSNorm",),
    "mixtral": ("MixtralRMSNorm",),
    "mistral": ("MistralRMSNorm", "MistralMLP"),
    "gemma": (),
    "gemma2": (),
    "gemma3_text": (),
    "gemma4_text": (),
    "cohere": ("CohereMLP",),
    "cohere2": ("Cohere2MLP",),
    "starcoder2": (),
    "exaone4": ("Exaone4RMSNorm", "Exaone4MLP"),
    "olmo2": ("Olmo2MLP",),
    "olmo3": ("Olmo3MLP",),
    "gpt_oss": (),
    "llama4_text": (),
    "deepseek_v3": ("DeepseekV3RMSNorm", "DeepseekV3MLP"),  # the dense layer's MLP and the shared expert
    "deepseek_v2": ("DeepseekV2RMSNorm", "DeepseekV2MLP"),
    "phimoe": (),  # LayerNorms, fused-expert tensors
    "modernbert-decoder": (),  # LayerNorms, a GeGLU MLP
    "granite": ("GraniteRMSNorm", "GraniteMLP"),
    "phi": (),
    "phi3": ("Phi3RMSNorm",),
    "phi3:longrope": ("Phi3RMSNorm",),
    "gpt_neox": (),
    "gpt2": (),
    "bloom": (),  # LayerNorms, a GELU MLP
    "mpt": (),  # LayerNorms, a GELU MLP
    "glm": ("GlmRMSNorm",),
    "smollm3": ("SmolLM3RMSNorm", "SmolLM3MLP"),
    "hunyuan_v1_moe": ("HunYuanMoEV1RMSNorm", "HunYuanMoEV1MLP"),
    "longcat_flash": ("LongcatFlashRMSNorm", "LongcatFlashMLP"),
    "qwen3_5_text": ("Qwen3_5MLP",),
    "qwen3_5_moe_text": ("Qwen3_5MoeMLP",),
    "qwen3_next": ("Qwen3NextMLP",),
    "olmo_hybrid": ("OlmoHybridMLP",),
    "kimi_linear": ("KimiLinearRMSNorm", "KimiLinearMLP"),
    "bailing_hybrid": ("BailingHybridRMSNorm", "BailingHybridMLP"),
    "nemotron_h": (),
    "granitemoehybrid": ("GraniteMoeHybridRMSNorm",),
    "bamba": ("BambaRMSNorm", "BambaMLP"),
    "falcon_h1": ("FalconH1RMSNorm",),
    "lfm2": ("Lfm2RMSNorm",),
    "lfm3": ("Lfm3RMSNorm",),
    "minimax": ("MiniMaxRMSNorm",),
    "zamba2": ("Zamba2RMSNorm",),
    "jamba": ("JambaRMSNorm", "JambaMLP"),
    "inkling2_text": (),
    "zaya": ("ZayaRMSNorm",),  # beside fused-expert tensors and a GELU router MLP
    "recurrent_gemma": (),
}
# the vision-language families of tests/test_image_families.py (their vision towers and projectors included)
LLAMA_FORM.update(
    {
        "qwen2_vl": ("Qwen2VLRMSNorm", "Qwen2MLP"),  # its vision tower's LayerNorms and GELU MLPs: not
        "qwen2_5_vl": (
            "Qwen2_5_VLRMSNorm",
            "Qwen2MLP",
        ),  # the vision tower's norms; its MLP reads `hidden_state`
        "qwen3_vl": ("Qwen3VLTextRMSNorm", "Qwen3VLTextMLP"),
        "qwen3_vl_moe": ("Qwen3VLMoeTextRMSNorm",),
        "qwen3_5": ("Qwen3_5MLP",),
        "qwen3_5_moe": ("Qwen3_5MoeMLP",),
        "gemma3": (),
        "gemma4": (),
        "mistral3": (
            "MistralRMSNorm",
            "MistralMLP",
            "PixtralRMSNorm",
            "Mistral3RMSNorm",
        ),  # Pixtral's GELU MLP: not
        "smolvlm": ("LlamaRMSNorm", "LlamaMLP"),
        "inkling2": (),
    }
)

# the families whose attention calls its modeling file's `apply_rotary_pos_emb` in a form batchrun's rotary kernel
# computes (engine/model/ops/fused_rotary.py), read from each modeling file: Llama's (q * cos + rotate_half(q) * sin with
# Llama's rotate_half), OLMo's (the same, cast to q's dtype), or partial rotary (cos's width rotated, the rest
# passed through: GPT-NeoX's, Phi-3's own, the Qwen 3.5 / Next and hybrids' copies). Not here: Cohere's
# (interleaved halves in fp32), GLM's and DeepSeek's interleaved pairs (DeepSeek-V3's config interleaves by
# default), Gemma 4's one-tensor function, GPT-OSS's own halves, Llama 4's complex products, the families with
# a rotary function of another name (DeepSeek-V2, Kimi, Bailing, LongCat, Inkling) and those without rotary
# (GPT-2, Jamba, Nemotron-H, and Granite's hybrid, whose config asks for none by default). Zaya's is the partial
# form, but the kernel declines its calls (fused_rotary: a call it does not compute exactly runs HF's function);
# ModernBERT-decoder's computes in fp32.
ROTARY_FORM = frozenset(
    {
        *("llama", "llama:dynamic_ntk", "exaone", "exaone4", "falcon_h1", "gemma", "gemma2", "gemma3_text"),
        *("granite", "hunyuan_v1_moe", "lfm2", "minimax", "mistral", "mixtral", "phi", "phimoe"),
        *("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "smollm3", "starcoder2", "zamba2"),
        *("olmo2", "olmo3", "olmo_hybrid", "lfm3"),  # OLMo's casts
        *("bamba", "gpt_neox", "phi3", "phi3:longrope", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"),
        "recurrent_gemma",
    }
)
# of those, the families whose rotary module gives cos/sin in fp32 whatever the model's dtype (hence OLMo's casts):
# in bf16 each call mixes dtypes, which the kernel declines, and HF's function runs
ROTARY_COS_IN_FP32 = frozenset({"olmo2", "olmo3", "olmo_hybrid", "lfm3"})

OWN_CODE = "its attention is computed in the model's own code"
REFUSED: dict[str, tuple[str, dict]] = {
    "falcon": ("does not go through transformers' attention interface", dict(_drop=["head_dim"])),
    "xglm": (f"{OWN_CODE} (XGLMAttention", {}),
    "openai-gpt": (f"{OWN_CODE} (Attention (modeling_openai.py)", {}),
    "gpt_neox_japanese": (f"{OWN_CODE} (GPTNeoXJapaneseAttention", {}),
    "cpmant": (f"{OWN_CODE} (CpmAntAttention", {}),
    "gpt_neo": (
        "does not go through transformers' attention interface",
        dict(attention_types=[[["global", "local"], 1]], window_size=WINDOW),
    ),
    "stablelm": ("does not pass batchrun's step metadata", {}),
    "deepseek_v32": ("sparse attention (DeepseekV32Indexer", {}),
    "glm_moe_dsa": ("sparse attention (GlmMoeDsaIndexer", {}),
    "deepseek_v4": ("sparse attention", {}),
    "qwen4_exp_text": (
        "sparse attention (Qwen4ExpTextQSAIndexer",
        dict(
            LINEAR,
            num_hidden_layers=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            indexer_n_heads=2,
            indexer_kv_heads=1,
            indexer_head_dim=16,
            indexer_budget=8,
            indexer_compress_ratio=4,
        ),
    ),
}


def tiny_config(family: str, overrides: dict):
    """`family`: a `model_type`, or `model_type:variant` for a second configuration of it."""
    from transformers import AutoConfig

    kw = dict(TINY)
    kw.update(overrides)
    for key in kw.pop("_drop", []):  # keys a family's config does not take
        del kw[key]
    return AutoConfig.for_model(family.split(":")[0], **kw)


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


def tiny_model(family: str, dtype):
    """The family's tiny model with HF's own attention: weights from seed 0, perturbed, then cast to `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, SUPPORTED[family][1]), dtype=torch.float32)
    perturb(model, seed=len(family))  # norm weights off 1, biases off 0
    return model.to(dtype).eval()
