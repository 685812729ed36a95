"""A CPU model's RMSNorms (in bf16/fp16 its SiLU-gated MLPs too) by C++ kernels (cpu_elementwise.cpp).

In bf16 the products run about twice as fast as in fp32, and HF's elementwise chains weigh twice as much: an
RMSNorm is six passes over the hidden states (upcast, square, mean, rsqrt and multiply, downcast, weight), a gated
MLP's `act_fn(gate) * up` three (what that costs of a bf16 prefill step, before and after: bench/RESULTS.md,
2026-12-05 evening, by bench/micro/step_profile.py). Each kernel is one pass, and makes the same roundings to the model's
dtype as HF's code; what it computes in fp32 in between is summed or exponentiated in another order, so a value
may differ from HF's by one unit in its last bf16/fp16 place (tests/test_fused_elementwise.py holds them to the
bf16 tolerance of the C++ kernels' tests, 1e-2). In fp32 the order would show, and fp32 tokens equal HF `generate`:
there only the RMSNorms are rewritten, bit-equal (`ExactRMSNorm`: ATen's own variance, then one C++ pass of the
steps after it), for the Python an fp32 step at a few sequences spends in HF's eight operations a norm.

Keyed on the module's structure at load, as fused_linear.py keys q/k/v: a module is replaced only when its class's
`forward` is, statement for statement, one this file knows (`NORM_FORWARDS`, `MLP_FORWARDS`: Llama's, which the
Llama-style families copy), its activation is SiLU, and nothing is hooked to it. Any other (Gemma's `1 + weight`
norm, a norm that computes in fp32 throughout, a GELU MLP) stays as the model wrote it. The replacement keeps the
module's parameters and children under their names; `restore` puts HF's modules back (the step profiler compares).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

import torch
from transformers.activations import SiLUActivation

from batchrun.engine import cpu_kernels
from batchrun.engine.model.ops.cpu_linear import hooked, plain_linear
from batchrun.engine.model.ops.fused_linear import FusedMember, FusedProduct

# the forwards the kernels compute (Llama's, and the same statements under the families' own class names)
NORM_FORWARDS = (
    """
def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
""",
)
MLP_FORWARDS = (
    """
def forward(self, x):
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj
""",
    """
def forward(self, x):
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
""",
)
DTYPES = (torch.bfloat16, torch.float16)


def statements(source: str) -> str | None:
    """A function's statements without its docstring, annotations or argument names' types, as a comparable
    string; None when the source cannot be read or parsed."""
    try:
        fn = ast.parse(textwrap.dedent(source)).body[0]
    except (SyntaxError, IndexError):
        return None
    if not isinstance(fn, ast.FunctionDef):
        return None
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    args = [a.arg for a in fn.args.args]
    return repr(args) + "".join(ast.dump(s) for s in body)


KNOWN_NORMS = {statements(s) for s in NORM_FORWARDS}
KNOWN_MLPS = {statements(s) for s in MLP_FORWARDS}


# transformers' own wrappers around a module's forward (argument renames, output capture, gradient checkpointing:
# each calls the forward it wraps, unchanged, at inference), by the file that defines them
TRANSFORMERS_WRAPPERS = tuple(
    "/transformers/" + f
    for f in ("utils/deprecation.py", "utils/generic.py", "utils/output_capturing.py", "modeling_layers.py")
)


def wrapped_by_transformers_alone(function) -> bool:
    """Every wrapper around `function` (a `functools.wraps` chain) is one of transformers' own: `inspect` reads
    the source of the function innermost, so a wrapper from elsewhere (one that changes the inputs or the output)
    would pass unseen as the form it wraps."""
    while hasattr(function, "__wrapped__"):
        code = getattr(function, "__code__", None)
        if code is None or not code.co_filename.replace("\\", "/").endswith(TRANSFORMERS_WRAPPERS):
            return False
        function = function.__wrapped__
    return True


@functools.cache
def forward_source(forward) -> str | None:
    """The source of a module class's `forward`, read once per function (reading a function's source tokenizes its
    whole file, and a load asks this of every norm, MLP, attention and layer); None when it cannot be read or a
    wrapper around it is not transformers' own (`wrapped_by_transformers_alone`). Every form check reads its
    forward here."""
    if not wrapped_by_transformers_alone(forward):
        return None
    try:
        return inspect.getsource(forward)
    except (OSError, TypeError):
        return None


def forward_of(module: torch.nn.Module) -> str | None:
    """The statements of the module's class forward (`statements`); None where `forward_source` gives none."""
    return _statements_of(type(module).forward)


@functools.cache
def _statements_of(forward) -> str | None:
    source = forward_source(forward)
    return None if source is None else statements(source)


def silu(module) -> bool:
    """HF's SiLU activation (ACT2FN["silu"]) or torch's, unhooked."""
    return type(module) in (SiLUActivation, torch.nn.SiLU) and not hooked(module)


class FusedRMSNorm(torch.nn.Module):
    """An RMSNorm of NORM_FORWARDS by the C++ kernel; its weight stays the module's `weight`."""

    def __init__(self, hf: torch.nn.Module, kernels):
        super().__init__()
        self.weight, self.variance_epsilon = hf.weight, float(hf.variance_epsilon)
        # in a list: HF's module is no child (its weight is counted once, under this module's name)
        self._hf, self._kernels = [hf], kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or x.device.type != "cpu" or x.requires_grad:
            return self._hf[0](x)  # HF's promotion rules or autograd: its own code
        out = torch.empty_like(x, memory_format=torch.contiguous_format)  # [..., H] rows: no reshape, no view
        eps = self.variance_epsilon
        if not self._kernels.rms_norm(out, x, self.weight, eps):  # rows not one stride apart: made so
            self._kernels.rms_norm(out, x.contiguous(), self.weight, eps)
        return out

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, one pass (C++)"


class ExactRMSNorm(torch.nn.Module):
    """An fp32 RMSNorm of NORM_FORWARDS in three operations instead of eight: the variance by ATen's own
    `pow(2).mean(-1)` (the sum's order would show), then the rest (`weight * (x * rsqrt(variance + eps))`) as one
    C++ pass whose every step is one IEEE operation, as ATen's are (cpu_elementwise.cpp `rms_norm_scale`): each
    value HF's bit for bit, with five fewer dispatches (the two `.to(float32)` of fp32 included, which change
    nothing and cost a call each). Its weight stays the module's `weight`."""

    def __init__(self, hf: torch.nn.Module, kernels):
        super().__init__()
        self.weight, self.variance_epsilon = hf.weight, float(hf.variance_epsilon)
        self._hf, self._kernels = [hf], kernels  # in a list: HF's module is no child

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.dtype != torch.float32
            or self.weight.dtype != x.dtype
            or x.device.type != "cpu"
            or x.requires_grad
        ):
            return self._hf[0](x)  # HF's promotion rules or autograd: its own code
        variance = x.pow(2).mean(-1, keepdim=True)  # of HF's own tensor, whatever its layout
        # made from x, as an elementwise result is (no shape from Python inside the forward: test_no_sync.py)
        out, eps = torch.empty_like(x, memory_format=torch.contiguous_format), self.variance_epsilon
        kernel = self._kernels.rms_norm_scale
        # rows not one stride apart (a q/k norm over a column slice of a fused q/k/v product): the rest is
        # elementwise, so the same values from a contiguous copy
        if kernel(out, x, variance, self.weight, eps) or kernel(
            out, x.contiguous(), variance, self.weight, eps
        ):
            return out
        return self._hf[0](x)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, fp32, bit-equal (C++ after the variance)"


class SiluAndMulMLP(torch.nn.Module):
    """A gated MLP of MLP_FORWARDS with `act_fn(gate) * up` as one C++ pass; its projections stay its children
    under their names (packed, fused or wrapped by an adapter: called as HF's code calls them). Where gate_proj
    and up_proj are the two members, in that order, of one fused product (fused_linear.py) and feed nothing but
    this MLP, the kernel reads the product's output whole, gate and up at their offsets, rather than the two
    column views the members would hand out. Where down_proj is a plain or packed linear layer, unhooked, the
    activation it alone reads is written into `scratch`, the model's MLPs' one tensor (outside autograd)."""

    def __init__(self, hf: torch.nn.Module, kernels, scratch: Scratch | None = None):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = hf.gate_proj, hf.up_proj, hf.down_proj
        self.act_fn = hf.act_fn
        self._hf, self._kernels = [hf], kernels
        self._joined = joined_product(self.gate_proj, self.up_proj)  # in a list or None: no child module
        self._scratch = scratch if plain_linear(self.down_proj) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._joined is not None:
            gate_up = self._joined[0].whole(x)
            n = gate_up.shape[-1] // 2
            if gate_up.dtype in DTYPES and not gate_up.requires_grad:
                shape = (*gate_up.shape[:-1], n)
                scratch = self._scratch
                if scratch is None or torch.is_grad_enabled():
                    h = torch.empty(shape, dtype=gate_up.dtype)
                else:
                    h = scratch.get(shape, gate_up.dtype)
                if self._kernels.silu_and_mul_halves(h, gate_up):
                    return self.down_proj(h)
            gate, up = gate_up.narrow(-1, 0, n), gate_up.narrow(-1, n, n)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if gate.dtype not in DTYPES or up.dtype != gate.dtype or gate.shape != up.shape or gate.requires_grad:
            return self.down_proj(self.act_fn(gate) * up)
        # views of the fused gate/up product's halves (rows strided, columns not), taken as they are
        h = torch.empty(gate.shape, dtype=gate.dtype)
        if not self._kernels.silu_and_mul(h, gate, up):
            self._kernels.silu_and_mul(h, gate.contiguous(), up.contiguous())
        return self.down_proj(h)


class Scratch:
    """One tensor that a model's fused MLPs write their activation into, one after another: each is read by its
    down_proj alone, which makes a new tensor of its own, before the next MLP runs. Kept at the last call's
    shape (a decode step's every layer, and the steps after, reuse it); another shape replaces it."""

    def __init__(self):
        self.tensor: torch.Tensor | None = None

    def get(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = self.tensor
        if t is None or t.shape != shape or t.dtype != dtype:
            t = self.tensor = torch.empty(shape, dtype=dtype)
        return t


def joined_product(gate: torch.nn.Module, up: torch.nn.Module) -> list[FusedProduct] | None:
    """[the fused product] whose only members are `gate` then `up`, of equal widths; else None."""
    if not (isinstance(gate, FusedMember) and isinstance(up, FusedMember)) or gate.group is not up.group:
        return None
    # the whole product would skip the members' calls, and their hooks with them
    if hooked(gate) or hooked(up):
        return None
    group = gate.group
    if (gate.index, up.index) != (0, 1) or len(group.widths) != 2 or group.widths[0] != group.widths[1]:
        return None
    return [group]


def norm_fits(module: torch.nn.Module, dtype: torch.dtype) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(weight, torch.nn.Parameter)
        and type(weight) is torch.nn.Parameter
        and weight.dim() == 1
        and weight.dtype == dtype
        and isinstance(getattr(module, "variance_epsilon", None), float)
        and not hooked(module)
        and not module._modules
        and forward_of(module) in KNOWN_NORMS
    )


def mlp_fits(module: torch.nn.Module) -> bool:
    return (
        all(getattr(module, n, None) is not None for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))
        and silu(module.act_fn)
        and not hooked(module)
        and forward_of(module) in KNOWN_MLPS
    )


def fuse(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Replace the RMSNorms and SiLU-gated MLPs of a bf16/fp16 CPU model that fit by their fused versions, and
    an fp32 model's RMSNorms by their bit-equal form (`ExactRMSNorm`; its MLPs stay HF's: torch's SiLU is not
    one IEEE operation); returns how many were replaced (0 where the C++ kernels cannot be built)."""
    if dtype not in (*DTYPES, torch.float32):
        return 0
    kernels = cpu_kernels.load()
    if kernels is None:
        return 0
    swaps, scratch = [], Scratch()
    for parent in model.modules():
        for name, child in parent.named_children():
            if norm_fits(child, dtype):
                norm = ExactRMSNorm if dtype == torch.float32 else FusedRMSNorm
                swaps.append((parent, name, norm(child, kernels)))
            elif dtype == torch.float32:
                continue
            elif mlp_fits(child):
                swaps.append((parent, name, SiluAndMulMLP(child, kernels, scratch)))
    for parent, name, fused in swaps:
        setattr(parent, name, fused)
    return len(swaps)


def restore(
    model: torch.nn.Module, fused: tuple[type, ...] = (FusedRMSNorm, ExactRMSNorm, SiluAndMulMLP)
) -> int:
    """Put HF's modules back in the place of the fused ones (of the classes `fused`, each holding its HF module
    as `_hf[0]`); returns how many."""
    swaps = [
        (parent, name, child._hf[0])
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, fused)
    ]
    for parent, name, hf in swaps:
        setattr(parent, name, hf)
    return len(swaps)
