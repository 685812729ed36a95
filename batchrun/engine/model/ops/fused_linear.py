"""Sibling linear layers that read the same input, computed as one product (on the CPU, one packed product).

HF's Llama-style attention calls `q_proj`, `k_proj` and `v_proj` one after another on the same hidden states,
its MLP `gate_proj` and `up_proj`, BERT's self-attention `query`, `key` and `value`. Separate products read the
input once each and hand oneDNN narrow problems (SmolLM2's `k_proj` and `v_proj` are 192 wide); one product of
the concatenated weights reads the input once, in one call, with a width the machine fills. HF's module code
stays as it is: each member of a group becomes a `FusedMember`. The first member called with an input computes
the whole group's product (`FusedProduct`) and keeps it; a sibling called with that same tensor (the same object,
not modified in place since) takes its columns as a view of it; a member called with anything else (a family
that projects keys from other states, as cross-attention does), or a second time for the same product, computes
the whole product for its own input and takes its columns. Each member's answer is therefore always its columns
of the product of its own input, whichever way the model calls it.

Groups are found by module structure (`SIBLINGS`: the names the families give them), and a group is fused only
when every member is one the caller would pack anyway (`eligible`: a plain float `nn.Linear`, not quantized, its
weight not read by the model's code, nothing hooked to its calls) with the same input width, dtype and device;
otherwise (a LoRA wrapper around one member, a hook on one) the group is left alone. The joined product's
columns were the members' own products bit for bit on the development machine, fp32 and bf16, 1 to 2,048 rows
(oneDNN splits a product's rows and columns between threads, not its sums); tests/test_fused_linear.py holds the
fp32 logits to the unfused model's within 1e-5, and the family matrix the tokens to HF `generate`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# names of sibling linear layers that the families' module code calls on the same input
SIBLINGS = (
    ("q_proj", "k_proj", "v_proj"),  # Llama, Qwen, Mistral, Gemma, ... attention
    ("query", "key", "value"),  # BERT-style self-attention (pooling models)
    ("gate_proj", "up_proj"),  # gated MLPs (SwiGLU, GeGLU)
)


class FusedProduct(torch.nn.Module):
    """The product of one input by the concatenated weights of a group's members, kept until each member has
    taken its columns. `products` and `calls` count what was computed and asked for (a group whose model
    calls every member on one input computes one product per len(widths) calls)."""

    def __init__(self, members: list[torch.nn.Linear], pack: Callable[[torch.nn.Linear], torch.nn.Module]):
        super().__init__()
        self.widths = [m.out_features for m in members]
        self.offsets = [sum(self.widths[:i]) for i in range(len(members))]
        first = members[0]
        joined = torch.nn.Linear(first.in_features, sum(self.widths), bias=False, device="meta")
        with torch.no_grad():
            joined.weight = torch.nn.Parameter(torch.cat([m.weight.detach() for m in members]), False)
            if any(m.bias is not None for m in members):  # a member without a bias adds zeros: exact
                biases = [
                    m.bias.detach() if m.bias is not None else first.weight.new_zeros(m.out_features)
                    for m in members
                ]
                joined.bias = torch.nn.Parameter(torch.cat(biases), False)
        self.product = pack(joined)
        self.products = self.calls = 0
        self._forget()

    def _forget(self) -> None:
        self._input: torch.Tensor | None = None
        self._version: int | None = None
        self._output: torch.Tensor | None = None
        self._taken: set[int] = set()

    def columns(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member `index`'s output for `x`: its columns of the kept product when `x` is the tensor that product
        was computed from (and no member took these columns of it yet), else of a new product of `x`."""
        self.calls += 1
        version = version_of(x)
        if x is not self._input or version != self._version or index in self._taken:
            self._forget()
            self._input, self._version, self._output = x, version, self.product(x)
            self.products += 1
        out = self._output.narrow(-1, self.offsets[index], self.widths[index])
        self._taken.add(index)
        if len(self._taken) == len(self.widths):  # every member served: let the input and the product go
            self._forget()
        return out

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """The whole product of `x`, for a caller that reads every member's columns of it itself (the fused
        SiLU-and-mul reads gate and up at their offsets: fused_elementwise.py); counted as a product and a call
        per member."""
        self.calls += len(self.widths)
        self.products += 1
        return self.product(x)

    def extra_repr(self) -> str:
        return f"widths={self.widths}"


def version_of(x: torch.Tensor) -> int | None:
    """The tensor's in-place modification counter; None for an inference tensor, which has none (the engine's
    forward runs under inference mode, where the HF modules' code, which never writes to a projection's input
    between its siblings' calls, is what keeps the kept product valid)."""
    return None if x.is_inference() else x._version


class FusedMember(torch.nn.Module):
    """A member of a fused group, in the place of its linear layer: its columns of the group's product."""

    def __init__(self, group: FusedProduct, index: int):
        super().__init__()
        self.group, self.index = group, index
        self.in_features, self.out_features = group.product.in_features, group.widths[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.columns(self.index, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, columns of a fused product"


def fusable(members: list[torch.nn.Module], eligible: Callable[[str, torch.nn.Module], bool], names) -> bool:
    """Every member one the caller would pack (checked first: a member that is not, a wrapper say, need not
    even have a weight), all of one input width, dtype and device, so that one product can stand for them."""
    first = members[0]
    return all(
        eligible(name, m)
        and m.in_features == first.in_features
        and m.weight.dtype == first.weight.dtype
        and m.weight.device == first.weight.device
        for name, m in zip(names, members)
    )


def fuse_siblings(
    model: torch.nn.Module,
    eligible: Callable[[str, torch.nn.Module], bool],
    pack: Callable[[torch.nn.Linear], torch.nn.Module],
) -> int:
    """Replace each group of sibling linear layers (`SIBLINGS`) whose members are all `eligible(name, module)`
    and alike by FusedMembers of one FusedProduct made with `pack`; returns how many groups were fused. Members
    of a group not fused are left as they are, for the caller to treat one by one."""
    groups = [
        (parent, names)
        for parent in model.modules()
        for names in SIBLINGS
        if all(parent._modules.get(n) is not None for n in names)
    ]
    fused = 0
    for parent, names in groups:
        members = [getattr(parent, n) for n in names]
        if not fusable(members, eligible, names):
            continue
        group = FusedProduct(members, pack)
        for i, name in enumerate(names):
            setattr(parent, name, FusedMember(group, i))
        fused += 1
    return fused


def fused_groups(model: torch.nn.Module) -> list[FusedProduct]:
    """The model's fused products (each once, however many members share it)."""
    return [m for m in model.modules() if isinstance(m, FusedProduct)]
