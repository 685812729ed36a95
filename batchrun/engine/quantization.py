"""Quantized checkpoints: what format a model's weights are in, how many bytes they really take, and which
batchrun extra brings the package a format needs.

batchrun runs a quantized checkpoint exactly as transformers loads it on this machine: transformers' quantizer
(compressed-tensors, torchao, bitsandbytes, fine-grained FP8, ...) builds the layers and their arithmetic, and
batchrun replaces only the attention function. It never packs or replaces a quantized layer
(cpu_linear.plain_float_linear), and where transformers would change the weights on the model's first forward
(compressed-tensors decompresses its packed integers then, on a CPU), batchrun does it at load
(`finish_loading`), so the weights counted before the run are the ones the run computes with.

One arithmetic needs more than that to stay exact: a layer that quantizes its input per token on the fly
(compressed-tensors W8A8 and FP8-dynamic) rounds the float product of the layer before it, whose last bits on a
CPU depend on how many rows the matrix library multiplies at once (its kernels for 1, for a few and for many rows
sum in other orders). Rounded to 8 bits, a last-bit difference becomes a step of 1/127 of the token's scale,
enough to change a greedy token: seen here, HF `generate` itself gives one prompt other tokens beside a copy of
itself than alone. HF `generate` runs a prompt alone, its prompt as one product and each decode as one row; so
such a layer makes its product once per sequence of the step (`call_per_sequence`), with the rows HF would give
it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from ..errors import BadInput
from .attention import AttentionMetadata

# a quantization_config's quant_method -> (the packages transformers needs for it, the batchrun extra bringing them)
PACKAGES: dict[str, tuple[tuple[str, ...], str]] = {
    "compressed-tensors": (("compressed_tensors",), "compressed-tensors"),
    "torchao": (("torchao",), "torchao"),
    "bitsandbytes": (("bitsandbytes",), "bitsandbytes"),
    # transformers' GPTQ quantizer is optimum's; the CPU kernels of GPTQ and AWQ are gptqmodel's
    "gptq": (("gptqmodel", "optimum"), "gptq"),
    "awq": (("gptqmodel",), "gptq"),
}


def checkpoint_format(config) -> str | None:
    """The quant_method of a model config's `quantization_config` (`compressed-tensors`, `fp8`, `torchao`,
    `bitsandbytes`...), or None for a checkpoint of plain float weights."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization.quant_method
    return str(getattr(method, "value", method))


def quantized(model: torch.nn.Module) -> bool:
    """Whether transformers loaded `model` through a quantizer (its `hf_quantizer`, or a `quantization_config` in
    its config): every layer's arithmetic is then the format's, and none is packed (a quantizer may also swap
    modules or weights after loading, as compressed-tensors' decompression does on the first forward)."""
    return (
        getattr(model, "hf_quantizer", None) is not None
        or getattr(model, "is_quantized", False) is True
        or checkpoint_format(getattr(model, "config", None)) is not None
    )


def missing_package(config, error: Exception) -> BadInput | None:
    """Loading failed and a package the format needs is not installed: a BadInput naming the format, the
    missing packages and the batchrun extra that brings them, with transformers' own first line (its
    `pip install X`, or for GPTQ without gptqmodel on a CPU "GPU is required"); None when every package is
    there (too old a version, say: transformers' own words then say what to do)."""
    method = checkpoint_format(config)
    if method not in PACKAGES:
        return None
    modules, extra = PACKAGES[method]
    missing = [module for module in modules if not installed(module)]
    if not missing:
        return None
    first = str(error).strip().splitlines()[0]
    packages = " and ".join(missing) + (" packages" if len(missing) > 1 else " package")
    return BadInput(
        f"model.path: the model is quantized in the {method} format, which needs the {packages}: "
        f"pip install 'batchrun[{extra}]' (transformers: {first})"
    )


def check_batch_invariant(config) -> None:
    """Refuses, naming the setting, a quantized checkpoint whose arithmetic for one sequence depends on the
    others batched beside it, which HF `generate` never batches it with: bitsandbytes' LLM.int8() with an
    outlier threshold computes in fp16 every input column where any row of the batch passes the threshold, and
    in int8 the rest, so one prompt's tokens change with its batch-mates (seen here: a different token at the
    11th; with the threshold at 0 a row's result is the same alone or in a batch)."""
    quantization = getattr(config, "quantization_config", None)
    if checkpoint_format(config) != "bitsandbytes":
        return
    get = (
        quantization.get if isinstance(quantization, dict) else lambda k, d=None: getattr(quantization, k, d)
    )
    threshold = get("llm_int8_threshold", 6.0)
    if get("load_in_8bit", False) and threshold:
        raise BadInput(
            f"model.path: the model is quantized with bitsandbytes 8-bit and llm_int8_threshold={threshold}: "
            "its outlier columns are chosen from the whole batch, so a prompt's tokens would depend on the "
            "prompts batched beside it (HF generate runs it alone); batchrun refuses it. Quantize it with "
            "llm_int8_threshold=0.0, or in 4-bit."
        )


def quantizes_its_input(module: torch.nn.Module) -> bool:
    """A compressed-tensors layer whose input activations are quantized when it is called (W8A8, FP8-dynamic)."""
    scheme = getattr(module, "quantization_scheme", None)
    return scheme is not None and getattr(scheme, "input_activations", None) is not None


def call_per_sequence(model: torch.nn.Module) -> int:
    """Makes every layer that quantizes its input (`quantizes_its_input`) multiply each sequence of a step apart,
    as HF `generate` multiplies one prompt (the module docstring says why); returns how many layers. The input's
    quantization runs once on the whole step (each token's scale is its own: the same, alone or packed); only
    the product is split. The module stays where it is, its class a subclass of `nn.Linear` whose forward splits
    the product: compressed-tensors' forward quantizes the input, then calls the module class's own forward."""
    layers = [m for m in model.modules() if quantizes_its_input(m) and type(m) is torch.nn.Linear]
    for module in layers:
        module.__class__ = PerSequenceLinear
    return len(layers)


class PerSequenceLinear(torch.nn.Linear):
    """`nn.Linear` whose product is made once per sequence of the step being run: a packed [1, T, in] input is
    split by the sequences' tokens (views, no copy) and each part multiplied alone. Outside a step (the load
    probe, a forward of its own) and on any other input it is `nn.Linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        step = getattr(AttentionMetadata.current(), "step", None)
        # the step's packed tokens (not an image encoder's patches, say), of more than one sequence
        if (
            step is None
            or x.dim() != 3
            or x.shape[:2] != (1, len(step.positions))
            or len(step.query_lens) == 1
        ):
            return super().forward(x)
        parts = x.split(step.query_lens, dim=1)
        return torch.cat([torch.nn.functional.linear(p, self.weight, self.bias) for p in parts], dim=1)


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def finish_loading(model: torch.nn.Module) -> None:
    """What transformers leaves for the model's first forward, done now: compressed-tensors keeps a CPU model's
    weights packed until then, and a forward pre-hook unpacks them (`ct_decompress_hook`, removed once it ran).
    Done at load, the weights' bytes counted for the summary and the budget are those of the run, and the
    arithmetic is the same one (the hook runs the same `decompress_model`)."""
    quantizer = getattr(model, "hf_quantizer", None)
    compressor = getattr(quantizer, "compressor", None)
    if hasattr(model, "ct_decompress_hook") and compressor is not None:
        compressor.decompress_model(model)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds in memory: a tensor subclass (torchao's quantized tensors) by the plain tensors it
    is made of (`__tensor_flatten__`), since its own `nbytes` is that of the float tensor it stands for."""
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return t.numel() * t.element_size()
    names, _ = t.__tensor_flatten__()
    return sum(tensor_bytes(getattr(t, name)) for name in names)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers as they are in memory, each tensor once (a tied LM head
    shares the embedding's)."""
    seen: set[int] = set()
    total = 0
    for t in (*model.parameters(), *model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += tensor_bytes(t)
    return total


@dataclass(frozen=True)
class Weights:
    """The model's weights for the job summary: their format and their bytes in memory."""

    format: str  # `float32`, or the checkpoint's quant_method (`, dequantized` where transformers did)
    bytes: int

    @classmethod
    def of(cls, model: torch.nn.Module, method: str | None) -> Weights:
        """`method`: the checkpoint's format (checkpoint_format), read before loading: transformers drops the
        `quantization_config` of a model it dequantized (fine-grained FP8 on a CPU)."""
        dtype = str(next(model.parameters()).dtype).replace("torch.", "")
        if method is None:
            fmt = dtype
        elif checkpoint_format(model.config) is None:
            fmt = f"{method}, dequantized to {dtype}"
        else:
            fmt = method
        return cls(fmt, weight_bytes(model))
