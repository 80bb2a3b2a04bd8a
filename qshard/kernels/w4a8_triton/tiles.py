"""The W4A8 tile kernel: int4 weights on FP8 tensor cores, for a 2-D weight and for experts.

One kernel for both (`DENSE`): a program takes (BLOCK_N weight rows, BLOCK_M tokens), "swap
AB" as the grouped kernels (`kernels/grouped/common.py`: which expert and rows a token block
stands for, found in the kernel from offs). Per K block of KB = min(group, 128) columns
(`kernels/w4a8.py`): the weight's bytes become two e4m3 planes, the low nibbles' u - z (the
block's even columns) and the high nibbles' (its odd columns), by bit placement in fp16 and
one conversion per two values (`e4m3_planes`), with no interleaving of the two; the
activations' e4m3 codes were stored in the same order (each block's even columns, then its odd
ones: the act-quant kernel's `split`, or per token by the launcher), so the block's dot is two
fp8 dots of KB / 2, one per plane; then it is promoted to fp32 with the weight's and the
activation's scales (DeepSeek-V3 §3.3.2).

Runs on sm_89+ (Triton's fp8 dot) with K blocks of 64 or more (`w4a8.kernel_problem`), and
under TRITON_INTERPRET=1 on the CPU for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..grouped.common import INTERPRETED, bias_args, expert_block, grid, store_tile, zero_tail

__all__ = ["config", "e4m3_planes", "launch"]


_INTERPRETED: tl.constexpr = tl.constexpr(INTERPRETED)

# The PTX of `e4m3_planes`, per 32-bit register of 4 code bytes ($2) and 4 zero-code bytes ($3,
# each the row's z): the bytes spread to fp16 halves (prmt); a nibble and-ed under the exponent
# of 1024 (one lop3) is the fp16 1024 + u, or 1024 + 16 u for the high nibble; then u - z is
# (1024 + u) - (1024 + z), or (1024 + 16 u) / 16 - (64 + z) in one fma, exactly (every value is
# an integer below 2048, and / 16 a power of two); two values at a time to e4m3 (cvt ...
# e4m3x2.f16x2) and the halves packed: $0 the low nibbles' u - z, $1 the high nibbles'.
_PLANES_PTX: tl.constexpr = tl.constexpr(
    """{
.reg .b32 t0, t1, z1, nz, a, b, sixteenth, minus_one, c960;
.reg .b16 h0, h1;
mov.b32 sixteenth, 0x2C002C00;
mov.b32 minus_one, 0xBC00BC00;
mov.b32 c960, 0x63806380;
prmt.b32 t0, $2, 0, 0x4140;
prmt.b32 t1, $2, 0, 0x4342;
lop3.b32 z1, $3, 0x000F000F, 0x64006400, 0xEA;
fma.rn.f16x2 nz, z1, minus_one, c960;
lop3.b32 a, t0, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 b, t1, 0x000F000F, 0x64006400, 0xEA;
sub.f16x2 a, a, z1;
sub.f16x2 b, b, z1;
cvt.rn.satfinite.e4m3x2.f16x2 h0, a;
cvt.rn.satfinite.e4m3x2.f16x2 h1, b;
mov.b32 $0, {h0, h1};
lop3.b32 a, t0, 0x00F000F0, 0x64006400, 0xEA;
lop3.b32 b, t1, 0x00F000F0, 0x64006400, 0xEA;
fma.rn.f16x2 a, a, sixteenth, nz;
fma.rn.f16x2 b, b, sixteenth, nz;
cvt.rn.satfinite.e4m3x2.f16x2 h0, a;
cvt.rn.satfinite.e4m3x2.f16x2 h1, b;
mov.b32 $1, {h0, h1};
}"""
)


@triton.jit
def e4m3_planes(packed, zero):
    """Code bytes [rows, H] (uint8) and each row's zero code (uint8, broadcast to [rows, H]) ->
    (e4m3 u - z of the low nibbles, of the high nibbles), each [rows, H]: the weight's even and
    odd columns, exactly (|u - z| <= 15). The interpreter, which runs no PTX, computes the same
    with Triton's ops."""
    if _INTERPRETED:
        codes = packed.to(tl.int32)
        z = zero.to(tl.int32)
        low = ((codes & 15) - z).to(tl.float32).to(tl.float8e4nv)
        high = ((codes >> 4) - z).to(tl.float32).to(tl.float8e4nv)
        return low, high
    else:
        low, high = tl.inline_asm_elementwise(
            _PLANES_PTX,
            "=r,=r,r,r",
            [packed, zero],
            dtype=(tl.int8, tl.int8),
            is_pure=True,
            pack=4,
        )
        return low.to(tl.float8e4nv, bitcast=True), high.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _w4a8_kernel(
    x_ptr,
    x_scale_ptr,
    w_ptr,
    w_scale_ptr,
    zero_ptr,
    bias_ptr,
    out_ptr,
    offs_ptr,
    E,
    T,
    N,
    K,
    stride_xm,
    stride_xsb,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_om,
    GROUP: tl.constexpr,
    KB: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    DENSE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    E_POW2: tl.constexpr,
):
    """out.T[n-tile, token block] = (u - z)[e][n-tile] @ xq[block].T, block by block. xq holds
    each K block's even columns, then its odd ones (`split_even_odd`), padded to whole blocks."""
    if DENSE:
        e, first, end, live = tl.program_id(1) * 0, tl.program_id(1) * BLOCK_M, T, True
    else:
        e, first, end, live = expert_block(offs_ptr, E, T, tl.program_id(1), BLOCK_M, E_POW2)
    if live:
        HALF: tl.constexpr = KB // 2
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = first + tl.arange(0, BLOCK_M)
        n_ok, m_ok = offs_n < N, (offs_m < end) & (offs_m >= 0)
        offs_half = tl.arange(0, HALF)
        w_ptr += e.to(tl.int64) * stride_we  # E * N * K / 2 may pass 2**31
        w_scale_ptr += e.to(tl.int64) * stride_se
        zero_ptr += e.to(tl.int64) * stride_se
        x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_half[None, :]
        w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_half[None, :]
        s_rows = offs_n.to(tl.int64) * stride_sn
        row_bytes = (K + 1) // 2
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for b in range(0, tl.cdiv(K, KB)):
            x_even = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            x_odd = tl.load(x_ptrs + HALF, mask=m_ok[:, None], other=0.0)
            x_scale = tl.load(x_scale_ptr + b * stride_xsb + offs_m, mask=m_ok, other=0.0)
            if EVEN_K:
                w_mask = n_ok[:, None]
            else:
                w_mask = n_ok[:, None] & (offs_half < row_bytes - b * HALF)[None, :]
            packed = tl.load(w_ptrs, mask=w_mask, other=0)
            g = (b * KB) // GROUP
            w_scale = tl.load(w_scale_ptr + s_rows + g, mask=n_ok, other=0.0).to(tl.float32)
            if SYMMETRIC:
                zero = tl.full((BLOCK_N,), 8, tl.uint8)
            else:
                zero = tl.load(zero_ptr + s_rows + g, mask=n_ok, other=0.0).to(tl.uint8)
            w_even, w_odd = e4m3_planes(packed, tl.broadcast_to(zero[:, None], packed.shape))
            partial = tl.dot(w_even, tl.trans(x_even))
            partial = tl.dot(w_odd, tl.trans(x_odd), partial)
            acc += partial * (w_scale[:, None] * x_scale[None, :])
            x_ptrs += KB
            w_ptrs += HALF
        store_tile(
            acc, bias_ptr, out_ptr, e, offs_n, offs_m, n_ok, m_ok, stride_be, stride_om, HAS_BIAS
        )
    else:
        zero_tail(out_ptr, first, end, N, stride_om, BLOCK_N, BLOCK_M)


def config(rows_per_block: int) -> dict:
    """The tile for `rows_per_block` tokens (a 2-D weight's M, an expert's mean routed rows):
    at most 16 a decode tile, up to 64 a 64-token tile, 128 tokens above."""
    if rows_per_block <= 16:
        return {"BLOCK_N": 64, "BLOCK_M": 16, "num_warps": 4, "num_stages": 4}
    if rows_per_block <= 64:
        return {"BLOCK_N": 128, "BLOCK_M": 64, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_N": 128, "BLOCK_M": 128, "num_warps": 8, "num_stages": 3}


_config = config  # (`launch`'s parameter of that name hides the function)


def launch(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    offs: torch.Tensor | None,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    group: int,
    k: int,
    config: dict,
) -> torch.Tensor:
    """out [T, N] = W4A8 of e4m3 activations xq [T, k] with scales x_scale [blocks, T] (a block's
    row at stride x_scale.stride(0): 0 for one scale per token) and int4 weights qdata
    [E, N, ceil(k/2)], scale / zero [E, N, groups] (zero empty: symmetric); offs int32 [E] the
    experts' end rows, or None for one 2-D weight (E = 1); bias [E, N] or None."""
    tokens = xq.shape[0]
    experts, n, _ = qdata.shape
    config = dict(config)
    if INTERPRETED:
        config.update(num_stages=1)
    dense = offs is None
    if dense:
        tile_grid = (triton.cdiv(n, config["BLOCK_N"]), triton.cdiv(tokens, config["BLOCK_M"]))
    else:
        tile_grid = grid(n, tokens, experts, config["BLOCK_N"], config["BLOCK_M"])
    bias_arg, stride_be = bias_args(bias, out)
    symmetric = zero.numel() == 0
    block = min(group, 128)
    _w4a8_kernel[tile_grid](
        xq,
        x_scale,
        qdata,
        scale,
        scale if symmetric else zero,
        bias_arg,
        out,
        out if dense else offs,
        experts,
        tokens,
        n,
        k,
        xq.stride(0),
        x_scale.stride(0),
        qdata.stride(0),
        qdata.stride(1),
        scale.stride(0),
        scale.stride(1),
        stride_be,
        out.stride(0),
        GROUP=group,
        KB=block,
        SYMMETRIC=symmetric,
        DENSE=dense,
        HAS_BIAS=bias is not None,
        EVEN_K=k % block == 0,
        E_POW2=triton.next_power_of_2(experts),
        **config,
    )
    return out
