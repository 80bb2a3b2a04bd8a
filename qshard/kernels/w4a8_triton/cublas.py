"""W4A8 by cuBLAS for prefill: the int4 codes expanded to e4m3 u - z once per call (a Triton
kernel writing `tiles.e4m3_planes`' two planes, each K block's even columns then its odd ones),
then `F.scaled_mm` with 1 x 128 scales on both operands (the activations' from the act-quant
kernel in the same column order, the weight's per (row, 128 columns)). The same definition
as the reference (kernels/w4a8.py): both operands permuted alike within each 128-column block,
which a dot product does not see. Groups of 128 or 256 (a 256 group's scale is repeated over
its two blocks), sm_90, N and K multiples of 128 with K / 128 a multiple of 4 (the cuBLAS
blockwise rules, availability.cublas_unavailable_reason).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..availability import cublas_unavailable_reason
from .tiles import e4m3_planes

__all__ = [
    "CUBLAS_MIN_TOKENS",
    "CUBLAS_M_MULTIPLE",
    "expand_codes",
    "launch",
    "problem",
    "weight_scales",
]

CUBLAS_M_MULTIPLE = 16
# From the Llama-3.1-8B layer on an H200 (bench/bench_w4a8.py; docs/kernels/w4a8.md): the tile
# kernel 178 us at 16 tokens, cuBLAS 232; at 128 tokens 377 against 283.
CUBLAS_MIN_TOKENS = 128
BLOCK = 128


def problem(x: torch.Tensor, n: int, k: int, group: int) -> str | None:
    """Why cuBLAS cannot run this W4A8 matmul here, or None."""
    if x.shape[0] < CUBLAS_MIN_TOKENS:
        return f"{x.shape[0]} tokens: the tile kernel is faster below {CUBLAS_MIN_TOKENS}"
    if group % BLOCK:
        return f"cuBLAS's 1 x 128 weight scales need groups of 128 or 256, not {group}"
    return cublas_unavailable_reason(x.device, n, k, BLOCK, BLOCK, BLOCK)


@triton.jit
def _expand_kernel(
    w_ptr,
    zero_ptr,
    out_ptr,
    N,
    stride_wn,
    stride_zn,
    SYMMETRIC: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    HALF: tl.constexpr = 64
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = tl.program_id(1)
    offs = tl.arange(0, HALF)
    n_ok = rows < N
    packed = tl.load(
        w_ptr + rows[:, None] * stride_wn + b * HALF + offs[None, :], mask=n_ok[:, None]
    )
    if SYMMETRIC:
        zero = tl.full((BLOCK_N,), 8, tl.uint8)
    else:
        g = (b * 128) // GROUP
        zero = tl.load(zero_ptr + rows * stride_zn + g, mask=n_ok, other=0.0).to(tl.uint8)
    even, odd = e4m3_planes(packed, tl.broadcast_to(zero[:, None], packed.shape))
    out = out_ptr + rows[:, None] * (2 * stride_wn) + b * 128 + offs[None, :]
    tl.store(out, even, mask=n_ok[:, None])
    tl.store(out + HALF, odd, mask=n_ok[:, None])


def expand_codes(qdata: torch.Tensor, zero: torch.Tensor, group: int) -> torch.Tensor:
    """int4 codes [N, K/2] (K a multiple of 128) -> e4m3 u - z [N, K], each 128-column block's
    even columns then its odd ones."""
    n, half = qdata.shape
    out = torch.empty((n, 2 * half), dtype=torch.float8_e4m3fn, device=qdata.device)
    symmetric = zero.numel() == 0
    grid = (triton.cdiv(n, 64), 2 * half // BLOCK)
    _expand_kernel[grid](
        qdata,
        qdata if symmetric else zero,
        out,
        n,
        qdata.stride(0),
        0 if symmetric else zero.stride(0),
        SYMMETRIC=symmetric,
        GROUP=group,
        BLOCK_N=64,
        num_warps=4,
    )
    return out


def weight_scales(w_scale: torch.Tensor) -> torch.Tensor:
    """The weight's [N, K/128] fp32 scales as `F.scaled_mm` takes 1 x 128 scales of its second
    operand: the first's layout mirrored, [N, K/128] with N contiguous."""
    return w_scale.t().contiguous().t()


def launch(xq, x_scale, qdata, scale, zero, bias, group: int, dtype: torch.dtype) -> torch.Tensor:
    """The W4A8 x @ W.T + bias [M, N] in `dtype` from the activations quantized in the kernel's
    column order (xq [M, K] e4m3, x_scale [K/128, M]; M a multiple of CUBLAS_M_MULTIPLE) and the
    int4 weight (qdata [N, K/2], scale / zero [N, K/group])."""
    weight = expand_codes(qdata, zero, group)
    w_scale = scale.float()
    if group > BLOCK:
        w_scale = w_scale.repeat_interleave(group // BLOCK, dim=1)[:, : weight.shape[1] // BLOCK]
    out = F.scaled_mm(
        xq,
        weight.t(),
        x_scale.contiguous().t(),
        F.ScalingType.BlockWise1x128,
        weight_scales(w_scale),
        F.ScalingType.BlockWise1x128,
        output_dtype=dtype,
    )
    return out + bias.to(out.dtype) if bias is not None else out
