"""The grouped 4-bit weight-only tensor-core kernel (int4, MXFP4, NVFP4; `common.py` for the
work split): the 2-D small-M kernel's steps (`w4a16.small_m.small_m_step`, `small_m_mma`: codes
decoded by bit placement, weights rounded to the activation dtype as the reference). Dequantizing
the experts for bf16 `_grouped_mm` at prefill was measured slower (docs/kernels/grouped.md) and
is not a path here."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..w4a16.decode import load_global_scale, scale_arg
from ..w4a16.small_m import small_m_mma, small_m_step
from .common import INTERPRETED, bias_args, expert_block, grid, store_tile, token_block, zero_tail

__all__ = ["config", "launch", "problem"]


def problem(fmt: int, k: int) -> str | None:
    """None: the kernel runs every 4-bit format and K (masked where K is not a multiple of its
    step)."""
    return None


def config(tokens: int, experts: int) -> dict:
    """64 weight rows x `token_block` tokens x 128 K per step."""
    return {
        "BLOCK_N": 64,
        "BLOCK_M": token_block(tokens, experts),
        "BLOCK_K": 128,
        "num_warps": 4,
        "num_stages": 3,
    }


@triton.jit
def _tiles_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    g_ptr,
    bias_ptr,
    out_ptr,
    offs_ptr,
    E,
    T,
    N,
    K,
    KH,
    stride_xm,
    stride_qe,
    stride_qn,
    stride_se,
    stride_sn,
    stride_ze,
    stride_be,
    stride_om,
    FORMAT: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    X_FP32: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    E_POW2: tl.constexpr,
):
    """out.T[n-tile, token block] = W[e][n-tile] @ x[block].T, BLOCK_K of K per step."""
    e, first, end, live = expert_block(offs_ptr, E, T, tl.program_id(1), BLOCK_M, E_POW2)
    if live:
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = first + tl.arange(0, BLOCK_M)
        m_ok = (offs_m < end) & (offs_m >= 0)
        expert = e.to(tl.int64)
        q_ptr += expert * stride_qe
        s_ptr += expert * stride_se
        z_ptr += expert * stride_ze
        global_scale = load_global_scale(g_ptr + e, FORMAT)
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm + offs_k[:, None]  # x.T
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for step in range(0, tl.cdiv(K, BLOCK_K)):
            k0 = step * BLOCK_K
            codes, scale, zero = small_m_step(
                q_ptr,
                s_ptr,
                z_ptr,
                offs_n,
                k0,
                N,
                K,
                KH,
                stride_qn,
                stride_sn,
                FORMAT,
                GROUP,
                BLOCK_K,
                EVEN_K,
            )
            x = tl.load(x_ptrs + k0, mask=m_ok[None, :] & (k0 + offs_k < K)[:, None], other=0.0)
            acc = small_m_mma(
                acc, codes, scale, zero, x, global_scale, FORMAT, GROUP, BLOCK_K, EVEN_K, X_FP32
            )
        store_tile(
            acc,
            bias_ptr,
            out_ptr,
            e,
            offs_n,
            offs_m,
            offs_n < N,
            m_ok,
            stride_be,
            stride_om,
            HAS_BIAS,
        )
    else:
        zero_tail(out_ptr, first, end, N, stride_om, BLOCK_N, BLOCK_M)


def launch(
    fmt: int, x, offs, qdata, scale, zero, global_scale, bias, out, group: int, k: int, config: dict
) -> torch.Tensor:
    """out [T, N] for x [T, k] sorted by expert (arguments as `ops.w4a16_grouped_launch`
    passes them: `zero` any tensor where the format has none, `bias` in x's dtype)."""
    tokens = x.shape[0]
    experts, n, kh = qdata.shape
    config = {key: v for key, v in config.items() if key != "KERNEL"}
    zero_arg, stride_ze = (zero, zero.stride(0)) if zero.numel() else (qdata, 0)
    bias_arg, stride_be = bias_args(bias, out)
    tile_grid = grid(n, tokens, experts, config["BLOCK_N"], config["BLOCK_M"])
    if INTERPRETED:
        config.update(num_stages=1)
    _tiles_kernel[tile_grid](
        x,
        qdata,
        scale_arg(scale),
        zero_arg,
        global_scale,
        bias_arg,
        out,
        offs,
        experts,
        tokens,
        n,
        k,
        kh,
        x.stride(0),
        qdata.stride(0),
        qdata.stride(1),
        scale.stride(0),
        scale.stride(1),
        stride_ze,
        stride_be,
        out.stride(0),
        FORMAT=int(fmt),
        GROUP=group,
        HAS_BIAS=bias is not None,
        E_POW2=triton.next_power_of_2(experts),
        EVEN_K=k % config["BLOCK_K"] == 0,
        X_FP32=x.dtype == torch.float32,
        **config,
    )
    return out
