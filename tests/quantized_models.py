"""Tiny quantized checkpoints, each made here by its format's own tooling from one tiny random-weight Llama (no
download): compressed-tensors' compressors (what llm-compressor calls to save), transformers' quantizers for
torchao and bitsandbytes, and transformers' own FP8 block quantizer for fine-grained FP8 (its quantizer refuses
to quantize without a GPU, but loads a quantized checkpoint on a CPU by dequantizing it).

`FORMATS`: name -> (the package it needs, the maker). Each maker writes a model directory with the embedded
default model's tokenizer beside the weights (tests/test_quantized.py; bench/quant.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch
from model_families import TINY

# the family matrix's tiny model (model_families.TINY), wider: every dimension a multiple of 64 (FP8 blocks of
# 64x64, bitsandbytes' 4-bit blocks) and of 128 where a compressed-tensors group is (its W4A16 groups of 128 run
# along the 128 and 256 input columns)
TINY_LLAMA = {**TINY, "hidden_size": 128, "intermediate_size": 256, "head_dim": 32}


def save_float(target: Path, tokenizer_dir: Path, **config) -> Path:
    """The float32 model every format quantizes: random weights from seed 0, the tokenizer of `tokenizer_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{**TINY_LLAMA, **config}), dtype=torch.float32)
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(target)
    return target


def compressed_tensors(scheme: str):
    """compressed-tensors' preset `scheme` on every linear layer but the LM head: its quantization config
    applied, each weight's scale and zero point from the weight's own range (calculate_qparams, what a
    min-max observer gives), then its compressors pack the weights and write the config."""

    def make(float_dir: Path, target: Path) -> None:
        from compressed_tensors.compressors import ModelCompressor
        from compressed_tensors.quantization import (
            QuantizationConfig,
            QuantizationStatus,
            apply_quantization_config,
            preset_name_to_scheme,
        )
        from compressed_tensors.quantization.utils import calculate_qparams
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
        config = QuantizationConfig(
            config_groups={"group_0": preset_name_to_scheme(scheme, ["Linear"])}, ignore=["lm_head"]
        )
        apply_quantization_config(model, config)
        for module in model.modules():
            args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if args is None:
                continue
            w = module.weight.detach()
            if args.strategy == "group":
                w = w.reshape(w.shape[0], -1, args.group_size)
            lo, hi = w.amin(-1), w.amax(-1)
            if args.strategy == "tensor":
                lo, hi = lo.amin(), hi.amax()
            scale, zero_point = calculate_qparams(lo, hi, args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
            module.quantization_status = QuantizationStatus.FROZEN
        compressor = ModelCompressor.from_pretrained_model(model)
        compressor.compress_model(model)
        model.save_pretrained(target)
        compressor.update_config(target)
        _copy_tokenizer(float_dir, target)

    return make


def quantized_at_load(quantization_config):
    """A format transformers quantizes into at load (torchao, bitsandbytes): loaded with its config from the
    float checkpoint, then saved quantized."""

    def make(float_dir: Path, target: Path) -> None:
        from transformers import AutoModelForCausalLM

        config = quantization_config()
        model = AutoModelForCausalLM.from_pretrained(
            float_dir, dtype=torch.float32, quantization_config=config, device_map="cpu"
        )
        model.save_pretrained(target)
        _copy_tokenizer(float_dir, target)

    return make


def torchao_int8() -> object:
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    return TorchAoConfig(Int8WeightOnlyConfig())


def bnb(bits: int, threshold: float = 0.0):
    """bitsandbytes at `bits`; 8-bit with LLM.int8()'s outlier `threshold` (0: none; batchrun refuses any
    other, quantization.check_batch_invariant)."""

    def config():
        from transformers import BitsAndBytesConfig

        if bits == 8:
            return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=threshold)
        return BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
        )

    return config


def fine_grained_fp8(float_dir: Path, target: Path) -> None:
    """Fine-grained FP8 (DeepSeek's and Qwen's format: e4m3 weights, one inverse scale per 64x64 block), each
    projection quantized by transformers' own Fp8Quantize (what its quantizer runs on a GPU)."""
    from safetensors.torch import load_file, save_file
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    shutil.copytree(float_dir, target, dirs_exist_ok=True)
    config = FineGrainedFP8Config(weight_block_size=(64, 64))
    quantize = Fp8Quantize(SimpleNamespace(quantization_config=config))
    weights = {}
    for key, value in load_file(float_dir / "model.safetensors").items():
        weights.update(quantize.convert({key: value}) if key.endswith("proj.weight") else {key: value})
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    model_config = json.loads((float_dir / "config.json").read_text())
    model_config["quantization_config"] = config.to_dict()
    (target / "config.json").write_text(json.dumps(model_config, indent=2))


def _copy_tokenizer(float_dir: Path, target: Path) -> None:
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(float_dir).save_pretrained(target)


# name -> (the package the format needs, or None for none beyond batchrun's own; its maker)
FORMATS = {
    "ct-w4a16": ("compressed_tensors", compressed_tensors("W4A16")),
    "ct-w8a8": ("compressed_tensors", compressed_tensors("W8A8")),
    "ct-fp8-dynamic": ("compressed_tensors", compressed_tensors("FP8_DYNAMIC")),
    "torchao-int8": ("torchao", quantized_at_load(torchao_int8)),
    "bnb-8bit": ("bitsandbytes", quantized_at_load(bnb(8))),
    "bnb-8bit-outliers": ("bitsandbytes", quantized_at_load(bnb(8, threshold=6.0))),
    "bnb-4bit": ("bitsandbytes", quantized_at_load(bnb(4))),
    "fp8": (None, fine_grained_fp8),
}
