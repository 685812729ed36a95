"""One way to prepare a model (engine/model/prepare.py): generation and pooling rewrite the same model the same way, in
the registry's order, and the rewrites that have an undo put HF's modules back."""

from __future__ import annotations

import copy

import pytest
import torch
from embedding_models import decoder_config, eos_appending_tokenizer

from batchrun.engine import cpu_kernels
from batchrun.engine.model.prepare import Preparation, prepare_model, undo

needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="the C++ kernels cannot be built here")


def rewritten(model: torch.nn.Module) -> list[tuple[str, str, bool]]:
    """Each module of `model`: its name, its class, and whether a forward was set on it (fused_residual's)."""
    return [(name, type(m).__name__, "forward" in vars(m)) for name, m in model.named_modules()]


@needs_kernels
def test_generation_and_pooling_prepare_one_decoder_the_same_way(tmp_path, model_dir):
    """A Qwen3-form checkpoint in bf16, loaded for generation and for pooling: the decoder stack both run comes
    out of the load with the same modules and the same forwards set on them (generation's LM head, which
    pooling has not, aside)."""
    from transformers import Qwen3ForCausalLM

    from batchrun import LLM

    tok = eos_appending_tokenizer(model_dir)
    torch.manual_seed(0)
    Qwen3ForCausalLM(decoder_config(len(tok), tok.eos_token_id)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    generation = LLM(str(tmp_path), dtype="bfloat16", device="cpu", num_pages=16)
    pooling = LLM(
        str(tmp_path), dtype="bfloat16", device="cpu", runner="pooling", pooler={"pooling": "lasttoken"}
    ).pooling
    layers = pooling.model.config.num_hidden_layers
    assert pooling.rewrites["fused_residual"] == generation.rewrites["fused_residual"] == layers
    assert pooling.rewrites["fused_elementwise"] == generation.rewrites["fused_elementwise"] > 0
    assert rewritten(generation.engine.runner.model.model) == rewritten(pooling.model)


def test_undo_puts_back_hfs_modules_and_logits():
    """An fp32 Llama prepared (its norms, rotary and residual adds rewritten, bit-equal) and undone: HF's module
    classes again, no forward left on a layer, and the logits HF's own bit for bit throughout."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    hf = copy.deepcopy(model)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(ids).logits
        counts = prepare_model(model, Preparation(torch.device("cpu"), torch.float32, pack_weights=False))
        if cpu_kernels.load() is not None:
            assert counts["fused_elementwise"] == 2 * 2 + 1 and counts["fused_residual"] == 2
        assert torch.equal(model(ids).logits, want)
        assert undo(model) == counts["fused_elementwise"] + counts["fused_residual"]
        assert rewritten(model) == rewritten(hf)
        assert torch.equal(model(ids).logits, want)
