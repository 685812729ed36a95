"""HF's `apply_rotary_pos_emb` by one C++ call while batchrun's forward runs (cpu_elementwise.cpp's
`rotary_embedding`), bit-equal to HF's in fp32 and bf16/fp16 alike.

HF's function is a chain of small operations per layer (two unsqueezes, then for q and for k two slices, a
negation, a concatenation, two products and a sum); the kernel makes the same products, roundings and sum in one
pass over q and k. HF's attention modules call the function of their modeling file by its global name, so the
function is what is replaced, one modeling module at a time, and only where it is, statement for statement, a
form this file knows (`FORMS`: Llama's, which most families copy; OLMo's, whose casts to q's dtype change
nothing when every input has that dtype; and the two partial-rotary ones, which rotate cos's width and pass
the rest through), and its `rotate_half` is Llama's. Any other (Cohere's interleaved halves, a function that computes
in fp32, DeepSeek's interleaved pairs, Llama 4's complex products) stays HF's.

How it is put in: the module's global becomes a `FusedRotary` holding HF's function. It takes the kernel only
inside `applied()`, which the model runner enters around its forward and leaves on the way out, exception or
not; anywhere else (an HF model in the same process, the same model outside the engine) it calls HF's function
with the same arguments. A context variable rather than swapping the global in and out each step: two engines
in threads of one process would restore each other's function out of order, and another thread's HF model
would see the kernel. The kernel also declines a call it does not compute exactly (other dtypes, devices or
shapes; cos wider than q), and then too HF's function runs: never an approximation.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from contextvars import ContextVar

import torch

from batchrun.engine import cpu_kernels
from batchrun.engine.model.ops.fused_elementwise import statements

NAME = "apply_rotary_pos_emb"
FORMS = {  # the forms the kernel computes, and whether cos may be narrower than q (partial rotary)
    """
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
""": False,
    """
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    q_type, k_type = q.dtype, k.dtype
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed.to(q_type), k_embed.to(k_type)
""": False,
    """
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)
    q_embed = torch.cat([q_embed, q_pass], dim=-1)
    k_embed = torch.cat([k_embed, k_pass], dim=-1)
    return q_embed, k_embed
""": True,
    """
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (rotate_half(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed
""": True,
}
ROTATE_HALF = """
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
"""
KNOWN = {statements(source): partial for source, partial in FORMS.items()}
_APPLIED: ContextVar[bool] = ContextVar("batchrun_fused_rotary", default=False)


class FusedRotary:
    """A modeling module's `apply_rotary_pos_emb`: the kernel inside `applied()`, HF's function (`hf`)
    elsewhere and for any call the kernel declines."""

    def __init__(self, hf, kernels, partial: bool):
        functools.update_wrapper(self, hf)
        self.hf, self._kernels, self.partial = hf, kernels, partial

    def __call__(self, q, k, cos, sin, unsqueeze_dim=1):
        if _APPLIED.get() and not (q.requires_grad or k.requires_grad):
            out = self._kernels.rotary_embedding(q, k, cos, sin, unsqueeze_dim, self.partial)
            if out:
                return out[0], out[1]
        return self.hf(q, k, cos, sin, unsqueeze_dim)


@contextlib.contextmanager
def applied():
    """The installed functions take the kernel within (the model runner's forward), HF's own after."""
    token = _APPLIED.set(True)
    try:
        yield
    finally:
        _APPLIED.reset(token)


def form_of(fn) -> bool | None:
    """Whether `fn` is a form the kernel computes with Llama's `rotate_half` (True: partial rotary allowed,
    False: cos as wide as q), or None: it is not."""
    if not inspect.isfunction(fn) or fn.__defaults__ != (1,) or fn.__kwdefaults__:
        return None
    globals_ = fn.__globals__
    if globals_.get("torch") is not torch or not inspect.isfunction(globals_.get("rotate_half")):
        return None
    try:
        own, rotate = inspect.getsource(fn), inspect.getsource(globals_["rotate_half"])
    except (OSError, TypeError):
        return None
    if statements(rotate) != statements(ROTATE_HALF):
        return None
    return KNOWN.get(statements(own))


def install(model: torch.nn.Module) -> int:
    """Put a FusedRotary in the place of `apply_rotary_pos_emb` in each modeling module whose attention
    modules in `model` call it and whose function is a known form (once per module: a second model finds it
    installed); returns how many of the model's modules call a fused one (0 where the kernels cannot be
    built here)."""
    kernels = cpu_kernels.load()
    if kernels is None:
        return 0
    count = 0
    for module in model.modules():
        forward = inspect.unwrap(type(module).forward)
        if NAME not in getattr(getattr(forward, "__code__", None), "co_names", ()):
            continue
        globals_ = forward.__globals__
        fn = globals_.get(NAME)
        if not isinstance(fn, FusedRotary):
            partial = form_of(fn)
            if partial is None:
                continue
            fn = globals_[NAME] = FusedRotary(fn, kernels, partial)
        count += 1
    return count
