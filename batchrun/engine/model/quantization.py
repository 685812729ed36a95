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

bitsandbytes' LLM.int8() with an outlier threshold (the default 6.0 of most 8-bit checkpoints) goes further: it
computes in fp16 every input column where any row it is given passes the threshold, and in int8 the rest, so a
packed step would choose a prompt's fp16 columns from its batch-mates' tokens too. Such a layer runs its whole
forward once per sequence of the step, and chooses each sequence's columns from that sequence alone.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from dataclasses import dataclass

import torch

from batchrun.engine.attention import AttentionMetadata
from batchrun.errors import BadInput

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


def quantizes_its_input(module: torch.nn.Module) -> bool:
    """A compressed-tensors layer whose input activations are quantized when it is called (W8A8, FP8-dynamic)."""
    scheme = getattr(module, "quantization_scheme", None)
    return scheme is not None and getattr(scheme, "input_activations", None) is not None


def chooses_columns_from_its_batch(module: torch.nn.Module) -> bool:
    """A bitsandbytes LLM.int8() layer with an outlier threshold: its fp16 columns are those where any row of its
    input passes the threshold (the module docstring)."""
    linear8bit = getattr(sys.modules.get("bitsandbytes.nn"), "Linear8bitLt", None)
    state = getattr(module, "state", None)
    return (
        linear8bit is not None and isinstance(module, linear8bit) and getattr(state, "threshold", 0.0) > 0.0
    )


def call_per_sequence(model: torch.nn.Module) -> int:
    """Makes every layer whose arithmetic for one token depends on the other rows it is given compute each
    sequence of a step apart, as HF `generate` computes one prompt (the module docstring says why); returns how
    many layers. A layer that quantizes its input (`quantizes_its_input`) quantizes the whole step once (each
    token's scale is its own: the same, alone or packed) and splits only its product (`PerSequenceLinear`: its
    forward quantizes the input, then calls the module class's own forward); an LLM.int8() layer with outliers
    (`chooses_columns_from_its_batch`) runs its whole forward per sequence (`PerSequenceForward`). Each module
    stays where it is, with a subclass of its own class."""
    count = 0
    for module in model.modules():
        if quantizes_its_input(module) and type(module) is torch.nn.Linear:
            module.__class__ = PerSequenceLinear
        elif chooses_columns_from_its_batch(module) and not isinstance(module, PerSequenceForward):
            module.__class__ = _per_sequence_class(type(module))
        else:
            continue
        count += 1
    return count


def _sequences(x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The step's packed [1, T, in] input split as HF `generate` multiplies it (`StepMetadata.generate_products`:
    a prompt as one product, each generated token alone), as views; None outside a step (the load probe, a
    forward of its own), for any other input (an image encoder's patches) and where the step is one product."""
    step = getattr(AttentionMetadata.current(), "step", None)
    if step is None or x.dim() != 3 or x.shape[:2] != (1, len(step.positions)):
        return None
    products = step.generate_products or step.query_lens
    return None if len(products) == 1 else x.split(products, dim=1)


def computes_per_sequence(model: torch.nn.Module) -> bool:
    """Whether some layer computes each sequence of a step apart (`call_per_sequence` made it so): only then
    does a step need the runs HF `generate` multiplies together (`StepMetadata.generate_products`)."""
    return any(isinstance(m, PerSequenceLinear | PerSequenceForward) for m in model.modules())


def computes_each_prompt_whole(model: torch.nn.Module) -> bool:
    """Whether a prompt's tokens must be one product, as HF `generate` makes it: LLM.int8() with outliers chooses
    its fp16 columns from all of them, so a prompt is never cut into chunks nor started from a prefix another
    prompt's product computed (the engine turns chunking and prefix sharing off)."""
    return any(isinstance(m, PerSequenceForward) for m in model.modules())


class PerSequenceLinear(torch.nn.Linear):
    """`nn.Linear` whose product is made once per sequence of the step being run; elsewhere `nn.Linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = _sequences(x)
        if parts is None:
            return super().forward(x)
        return torch.cat([torch.nn.functional.linear(p, self.weight, self.bias) for p in parts], dim=1)


class PerSequenceForward:
    """Mixed in before a layer's own class: its whole forward runs once per sequence of the step being run;
    elsewhere it is the layer's own forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        forward = super().forward
        parts = _sequences(x)
        if parts is None:
            return forward(x)
        return torch.cat([forward(p) for p in parts], dim=1)


@functools.cache
def _per_sequence_class(cls: type) -> type:
    return type(f"PerSequence{cls.__name__}", (PerSequenceForward, cls), {})


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
