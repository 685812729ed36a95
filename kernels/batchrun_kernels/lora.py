"""LoRA on a GPU: each token's adapter applied in two Triton kernels over the adapters' stacked weights.

The step's packed tokens [T, in] each carry a slot (the adapter loaded there; -1: the base model). `lora_shrink`
makes y[t] = A[slot(t)] x[t] (rank R at most, the stack padded with zeros past an adapter's rank), `lora_expand`
adds scale[slot(t)] * B[slot(t)] y[t] to the base product's row t, in float32, then back to its dtype. One
program per (token, block of outputs): every token of the step in one launch each, whatever its adapter, so a
step of many adapters costs two launches per layer, not two per adapter. `ref_lora` is the plain PyTorch
computation they are tested against (tests/test_lora.py, under Triton's interpreter on a CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink(
    x_ptr,
    a_ptr,
    slot_ptr,
    y_ptr,
    IN,
    R,
    stride_x,
    stride_as,
    stride_ar,
    stride_y,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    rank = tl.where(slot >= 0, R, 0)  # a base token's row: nothing read, nothing written
    slot = tl.maximum(slot, 0)
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, IN, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t * stride_x + k, mask=k < IN, other=0.0).to(tl.float32)
        a_mask = (r[:, None] < rank) & (k[None, :] < IN)
        a = tl.load(a_ptr + slot * stride_as + r[:, None] * stride_ar + k[None, :], mask=a_mask, other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    tl.store(y_ptr + t * stride_y + r, acc, mask=r < rank)


@triton.jit
def _expand(
    y_ptr,
    b_ptr,
    scale_ptr,
    slot_ptr,
    out_ptr,
    OUT,
    R,
    stride_y,
    stride_bs,
    stride_bn,
    stride_o,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slot_ptr + t)
    width = tl.where(slot >= 0, OUT, 0)  # a base token's row is left as the base product made it
    slot = tl.maximum(slot, 0)
    r = tl.arange(0, BLOCK_R)
    y = tl.load(y_ptr + t * stride_y + r, mask=r < tl.where(width > 0, R, 0), other=0.0)
    b_mask = (n[:, None] < width) & (r[None, :] < R)
    b = tl.load(b_ptr + slot * stride_bs + n[:, None] * stride_bn + r[None, :], mask=b_mask, other=0.0)
    delta = tl.sum(b.to(tl.float32) * y[None, :], axis=1) * tl.load(scale_ptr + slot)
    out_mask = n < width
    base = tl.load(out_ptr + t * stride_o + n, mask=out_mask, other=0.0)
    tl.store(
        out_ptr + t * stride_o + n, (base.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=out_mask
    )


DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the model's (x and the base product)
RANK_BLOCKS = (16, 32, 64, 128, 256)  # next_power_of_2(rank), at least 16: engine.max_lora_rank up to 256
BLOCK_N = 64


def block_k(block_r: int) -> int:
    """The shrink's input block: a [BLOCK_R, BLOCK_K] tile of at most 4096 elements (larger ones spill registers:
    `make kernels-check`)."""
    return min(64, max(16, 4096 // block_r))


def specializations():
    """Every (kernel, dtype, compile-time arguments, launch options, argument types) the launcher can produce,
    for `make kernels-check` (the stacked weights, scales and shrunk rows are float32 whatever the model's dtype;
    the slots int32)."""
    for dtype in DTYPES:
        for block_r in RANK_BLOCKS:
            types = {
                "a_ptr": "*fp32",
                "b_ptr": "*fp32",
                "y_ptr": "*fp32",
                "scale_ptr": "*fp32",
                "slot_ptr": "*i32",
            }
            yield _shrink, dtype, dict(BLOCK_R=block_r, BLOCK_K=block_k(block_r)), {"num_warps": 4}, types
            yield _expand, dtype, dict(BLOCK_R=block_r, BLOCK_N=BLOCK_N), {"num_warps": 4}, types


def lora_apply(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scales: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """out[t] += scales[s] * b[s] @ (a[s] @ x[t]) for each token t of slot s = slots[t] >= 0, in place.
    x [T, in]; a [S, R, in]; b [S, out, R]; scales [S] float32; slots [T] int32; out [T, out] (contiguous rows)."""
    T, IN = x.shape
    R, OUT = a.shape[1], b.shape[1]
    assert a.shape[2] == IN and b.shape[2] == R and out.shape == (T, OUT) and slots.shape == (T,)
    assert x.stride(1) == 1 and a.stride(2) == 1 and b.stride(2) == 1 and out.stride(1) == 1
    if T == 0:
        return
    block_r = max(16, triton.next_power_of_2(R))
    y = torch.empty(T, R, device=x.device, dtype=torch.float32)
    _shrink[(T,)](
        x,
        a,
        slots,
        y,
        IN,
        R,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        y.stride(0),
        BLOCK_R=block_r,
        BLOCK_K=block_k(block_r),
    )
    block_n = BLOCK_N
    _expand[(T, triton.cdiv(OUT, block_n))](
        y,
        b,
        scales,
        slots,
        out,
        OUT,
        R,
        y.stride(0),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        BLOCK_R=block_r,
        BLOCK_N=block_n,
    )


def ref_lora(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scales: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """What `lora_apply` computes, in PyTorch: a new tensor (out is left as it is)."""
    result = out.float().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            result[t] += scales[s] * (b[s].float() @ (a[s].float() @ x[t].float()))
    return result.to(out.dtype)
