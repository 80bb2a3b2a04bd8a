"""Per-token-group FP8 activation quantization (e4m3, one fp32 scale per 1 x GROUP group),
shared by the FP8 blockwise kernels, the cuBLAS path and the grouped experts kernel:
`quantize_rows` in registers (the GEMV and small-M kernels fuse it), `act_quant_launch` as a
kernel of its own, and the op `torch.ops.qshard.fp8_act_quant`. The definition is
`kernels/fp8_blockwise.py`'s reference; tests compare bit for bit.

Activation scales are stored group-major, [ceil(K/group), M] (M contiguous): the GEMM reads a
row of them per K step, coalesced, and it is the layout cuBLAS wants for its 1x128 scales.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..fp8_blockwise import E4M3_MAX

__all__ = ["INTERPRETED", "act_quant", "act_quant_launch", "quantize_rows"]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _round_up_to_power_of_two(scale):
    """UE8M0: the smallest power of two >= scale, on the bits (as the reference)."""
    bits = scale.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    has_mantissa = ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return ((exponent + has_mantissa) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_e4m3_grid(v):
    """fp32 values in [-448, 448] rounded to nearest-even e4m3 values, still in fp32: normals
    keep 3 mantissa bits (a carry moves into the exponent), subnormals are multiples of 2**-9
    (adding and subtracting 1.5 * 2**14 rounds the magnitude there). Used under the Triton
    interpreter, whose fp32 -> e4m3 cast (triton 3.9) drops the carry (124.3 -> 64, not 128)."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    magnitude = (tl.abs(v) + 24576.0) - 24576.0
    subnormal = tl.where(v < 0, -magnitude, magnitude)  # keeps the sign of a zero (-0.0)
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def quantize_rows(x, UE8M0: tl.constexpr, EXACT_CAST: tl.constexpr, EXACT_DIV: tl.constexpr):
    """[rows, group] fp32 -> (e4m3 [rows, group], fp32 scales [rows]), as the reference:
    scale = amax / 448 (1.0 for an all-zero group), q = clamp(x / scale) rounded to nearest.
    Both ways give the correctly rounded quotient (Triton's default fp32 `/` is approximate):
    EXACT_DIV divides each value with div_rn (a ~10-instruction sequence); otherwise (the fused
    GEMM paths, which redo this per program) q0 = x * RN(1 / scale) is corrected with two FMAs
    (Markstein: q = q0 + (x - q0 * scale) * RN(1 / scale)). Without the correction, bf16
    activations often land on e4m3 rounding midpoints and 0.05 % of codes differed (review).
    A subnormal scale (amax < 448 * 2**-126) would overflow 1 / scale: such groups are scaled by
    2**64 first, exactly, and the stored scale is unchanged."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    scale = tl.where(scale > 0, scale, 1.0)
    if UE8M0:
        scale = _round_up_to_power_of_two(scale)
    if EXACT_DIV:
        q = tl.math.div_rn(x, scale[:, None])
    else:
        tiny = scale < 1.1754943508222875e-38  # 2**-126
        divisor = tl.where(tiny, scale * 18446744073709551616.0, scale)[:, None]  # * 2**64
        x = tl.where(tiny[:, None], x * 18446744073709551616.0, x)
        reciprocal = tl.math.div_rn(tl.full(divisor.shape, 1.0, tl.float32), divisor)
        q0 = x * reciprocal
        q = tl.fma(tl.fma(-q0, divisor, x), reciprocal, q0)
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    if EXACT_CAST:
        q = _round_to_e4m3_grid(q)
    return q.to(tl.float8e4nv), scale


@triton.jit
def _act_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    stride_xm,
    stride_qm,
    GROUP: tl.constexpr,
    UE8M0: tl.constexpr,
    EXACT_CAST: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    offs = tl.arange(0, GROUP)
    cols = g * GROUP + offs
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    q, scale = quantize_rows(x.to(tl.float32), UE8M0, EXACT_CAST, True)
    if SPLIT:  # the group's even columns, then its odd ones, every column written (zeros past K)
        cols = g * GROUP + (offs % 2) * (GROUP // 2) + offs // 2
        mask = (rows < M)[:, None] & (cols < stride_qm)[None, :]
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=mask)
    tl.store(s_ptr + g * M + rows, scale, mask=rows < M)


def act_quant_launch(x: torch.Tensor, group: int, ue8m0: bool, split: bool = False):
    """[M, K] float -> (e4m3 [M, K], fp32 scales [ceil(K/group), M] group-major). `split`: each
    group's even columns first, then its odd ones, and K padded with zeros to whole groups
    ([M, ceil(K/group) * group]; the W4A8 kernel's order, kernels/w4a8_triton/tiles.py)."""
    m, k = x.shape
    width = -(-k // group) * group if split else k
    q = torch.empty((m, width), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((-(-k // group), m), dtype=torch.float32, device=x.device)
    if m and k:
        block_m = 16 if m >= 16 else 1 << (m - 1).bit_length()
        grid = (triton.cdiv(m, block_m), triton.cdiv(k, group))
        _act_quant_kernel[grid](
            x,
            q,
            scales,
            m,
            k,
            x.stride(0),
            q.stride(0),
            GROUP=group,
            UE8M0=ue8m0,
            EXACT_CAST=INTERPRETED,
            SPLIT=split,
            BLOCK_M=block_m,
            num_warps=4,
        )
    return q, scales


@torch.library.custom_op("qshard::fp8_act_quant", mutates_args=())
def act_quant(x: torch.Tensor, group: int, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group e4m3 quantization: (q [M, K], scales [ceil(K/group), M])."""
    return act_quant_launch(x.contiguous(), group, ue8m0)


@act_quant.register_fake
def _(x, group, ue8m0):
    m, k = x.shape
    q = x.new_empty((m, k), dtype=torch.float8_e4m3fn)
    return q, x.new_empty((-(-k // group), m), dtype=torch.float32)


assert E4M3_MAX == 448.0  # the kernels hard-code the e4m3 range
