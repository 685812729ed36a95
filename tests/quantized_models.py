"""Tiny quantized checkpoints, each made here by its format's own tooling from one tiny random-weight Llama (no
download): compressed-tensors' compressors (what llm-compressor calls to save), transformers' quantizers for
torchao and bitsandbytes, gptqmodel's quantizer for GPTQ and AWQ, and transformers' own FP8 block quantizer
for fine-grained FP8 (its quantizer refuses
to quantize without a GPU, but loads a quantized checkpoint on a CPU by dequantizing it). MXFP4 is written
here (`to_mxfp4`, from the OCP Microscaling spec): transformers' MXFP4 quantizer needs the Hub's Triton kernels.

`FORMATS`: name -> (the package it needs, the maker). Each maker writes a model directory with the embedded
default model's tokenizer beside the weights (tests/test_quantized.py; bench/quant.py)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
from model_families import MOE, TINY, WINDOW, perturb, tiny_config

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
    """bitsandbytes at `bits`; 8-bit with LLM.int8()'s outlier `threshold` (0: none; above, each sequence of a
    step runs the layer apart: quantization.call_per_sequence)."""

    def config():
        from transformers import BitsAndBytesConfig

        if bits == 8:
            return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=threshold)
        return BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
        )

    return config


def gptqmodel_quantized(method: str):
    """GPTQ or AWQ, 4 bits in groups of 64, by gptqmodel's own quantizer (whose layers transformers' GPTQ and
    AWQ loaders build), calibrated on 8 random token sequences of 64; AWQ with zero points (AutoAWQ's GEMM
    format, most AWQ uploads'), GPTQ symmetric (gptqmodel's default)."""

    def make(float_dir: Path, target: Path) -> None:
        # gptqmodel's CPU thread pool has a worker per 2 CPUs, and its model loader asks for 2: on a 2-CPU
        # machine its load stops ("requests 2 workers but parent 'cpu' only has 1") unless given 2
        os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
        from gptqmodel import GPTQModel, QuantizeConfig

        vocab = json.loads((float_dir / "config.json").read_text())["vocab_size"]
        g = torch.Generator().manual_seed(0)
        calibration = [
            {"input_ids": ids, "attention_mask": [1] * len(ids)}
            for ids in torch.randint(3, vocab, (8, 64), generator=g).tolist()
        ]
        config = QuantizeConfig(bits=4, group_size=64, method=method, sym=method == "gptq")
        # its quantizer writes its logs to ./logs: in a scratch directory, not the checkout
        with tempfile.TemporaryDirectory() as scratch, contextlib.chdir(scratch):
            model = GPTQModel.load(str(float_dir), config, device="cpu")
            model.quantize(calibration, batch_size=1)
            model.save(str(target))

    return make


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


# e2m1's magnitudes; a 4-bit code is the magnitude's index, plus 8 when negative (the OCP Microscaling format)
FP4_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def to_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 as the OCP Microscaling spec defines it: each run of 32 values along the last dimension shares a
    power-of-two scale, 2^(floor(log2(the run's largest magnitude)) - 2) so that the largest lands in
    [4, 8) of e2m1's range (up to 6, saturating), and each value is its nearest e2m1 number times that scale.
    Returns the codes two to a byte (the even value in the low nibble) in blocks of 16 bytes, `[..., n/32, 16]`,
    and each run's exponent biased by 127, `[..., n/32]`: the `_blocks` and `_scales` of gpt-oss's checkpoints."""
    runs = weight.float().reshape(*weight.shape[:-1], -1, 32)
    largest = runs.abs().amax(-1, keepdim=True)
    exponent = torch.where(largest > 0, torch.floor(torch.log2(largest)) - 2, torch.full_like(largest, -127))
    exponent = exponent.clamp(-127, 127)
    scaled = runs / torch.exp2(exponent)
    magnitude = torch.bucketize(scaled.abs(), (FP4_MAGNITUDES[1:] + FP4_MAGNITUDES[:-1]) / 2)
    codes = (magnitude + 8 * (scaled < 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent.squeeze(-1) + 127).to(torch.uint8)


def mxfp4(float_dir: Path, target: Path) -> None:
    """MXFP4, gpt-oss's format (its experts' weights in 4 bits, the rest in bf16 or here fp32). It exists for
    gpt-oss's experts alone, so this makes a gpt-oss of the float model's shape (layers, widths, heads,
    vocabulary; 4 experts, 2 per token, sinks and biases perturbed, every other layer in a sliding window) and
    writes its experts as the published checkpoints do: `gate_up_proj_blocks`/`_scales` in runs of 32 along the
    hidden size, `down_proj_blocks`/`_scales` along the intermediate size (transformers' own quantizer needs
    the Hub's Triton kernels). transformers dequantizes them at load on a CPU."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    shape = json.loads((float_dir / "config.json").read_text())
    shape = {key: shape[key] for key in TINY if key in shape}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        tiny_config("gpt_oss", {**shape, **MOE, "sliding_window": WINDOW}), dtype=torch.float32
    )
    perturb(model, 0)
    model.save_pretrained(target)
    weights = {}
    for key, value in load_file(target / "model.safetensors").items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # stored [experts, in, out]; the runs of 32 go along `in`, each output row's
            blocks, scales = to_mxfp4(value.transpose(1, 2))
            weights.update({f"{key}_blocks": blocks, f"{key}_scales": scales})
        else:
            weights[key] = value
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (target / "config.json").write_text(json.dumps(config, indent=2))
    _copy_tokenizer(float_dir, target)


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
    "mxfp4": (None, mxfp4),
    "gptq": ("gptqmodel", gptqmodel_quantized("gptq")),
    "awq": ("gptqmodel", gptqmodel_quantized("awq")),
}
