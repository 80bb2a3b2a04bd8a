"""The grouped FP8 blockwise W8A8 kernel (`common.py` for the work split): the activations
quantized per 1 x GROUP group once beforehand by the act-quant kernel (PREQUANT, the default:
measured faster at every size, `config`), or in registers by each tile (`quantize_rows`); each
group's fp8 dot is promoted with its scales in fp32 (DeepSeek-V3 §3.3.2), as the 2-D Triton
kernels (`kernels/fp8/`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8.act_quant import act_quant_launch, quantize_rows
from .common import INTERPRETED, bias_args, expert_block, grid, store_tile, token_block, zero_tail

__all__ = ["config", "launch", "problem"]


def problem(x: torch.Tensor, qdata: torch.Tensor) -> str | None:
    """None: the kernel runs every shape of FP8 blockwise experts it is given."""
    return None


@triton.jit
def _fp8_kernel(
    x_ptr,
    x_scale_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    offs_ptr,
    E,
    T,
    N,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_be,
    stride_om,
    W_BLOCK_N: tl.constexpr,
    W_BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    UE8M0: tl.constexpr,
    EXACT_CAST: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    PREQUANT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    E_POW2: tl.constexpr,
):
    """out.T[n-tile, token block] = W[e][n-tile] @ xq[block].T, group by group."""
    e, first, end, live = expert_block(offs_ptr, E, T, tl.program_id(1), BLOCK_M, E_POW2)
    if live:
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = first + tl.arange(0, BLOCK_M)
        n_ok, m_ok = offs_n < N, (offs_m < end) & (offs_m >= 0)
        offs_k = tl.arange(0, GROUP)
        w_ptr += e.to(tl.int64) * stride_we  # E * N * K may pass 2**31 (DeepSeek-V3: 7.5e9)
        w_scale_ptr += e.to(tl.int64) * stride_wse
        x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        w_scale_ptrs = w_scale_ptr + (offs_n // W_BLOCK_N) * stride_wsn
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for g in range(0, tl.cdiv(K, GROUP)):
            if EVEN_K:
                x_mask, w_mask = m_ok[:, None], n_ok[:, None]
            else:
                k_ok = offs_k < K - g * GROUP
                x_mask, w_mask = m_ok[:, None] & k_ok[None, :], n_ok[:, None] & k_ok[None, :]
            if PREQUANT:
                xq = tl.load(x_ptrs, mask=x_mask, other=0.0)
                x_scale = tl.load(x_scale_ptr + g * T + offs_m, mask=m_ok, other=0.0)
            else:  # padded rows quantize to 0 with scale 1
                x = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)
                xq, x_scale = quantize_rows(x, UE8M0, EXACT_CAST, False)
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
            w_scale = tl.load(w_scale_ptrs + (g * GROUP) // W_BLOCK_K, mask=n_ok, other=0.0)
            acc += tl.dot(w, tl.trans(xq)) * (w_scale[:, None] * x_scale[None, :])
            x_ptrs += GROUP
            w_ptrs += GROUP
        store_tile(
            acc, bias_ptr, out_ptr, e, offs_n, offs_m, n_ok, m_ok, stride_be, stride_om, HAS_BIAS
        )
    else:
        zero_tail(out_ptr, first, end, N, stride_om, BLOCK_N, BLOCK_M)


def config(block_m: int) -> dict:
    """The best of the H100 sweep (bench/bench_moe.py --sweep, docs/kernels/grouped.md) on the
    Qwen3-30B-A3B and DeepSeek-V3 gate_up: activations quantized beforehand at every size
    (the act-quant kernel costs less than each tile redoing it: 15 vs 20 us at 1 token), 64
    weight rows x 16 tokens for decode, 128 x 64 for prefill (546 us at 4096 tokens, vs 696
    for 128 x 128 with 8 warps)."""
    if block_m <= 32:
        return {
            "BLOCK_N": 64,
            "BLOCK_M": block_m,
            "PREQUANT": True,
            "num_warps": 4,
            "num_stages": 3,
        }
    return {"BLOCK_N": 128, "BLOCK_M": 64, "PREQUANT": True, "num_warps": 4, "num_stages": 4}


_config = config  # (`launch`'s parameter of that name hides the function)


def launch(
    x: torch.Tensor,
    offs: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    block_n: int,
    block_k: int,
    group: int,
    ue8m0: bool,
    config: dict | None = None,
) -> torch.Tensor:
    """x [T, K] sorted by expert, offs int32 [E], FP8 blockwise experts (qdata [E, N, K], scale
    [E, ceil(N/bn), ceil(K/bk)]), bias [E, N] or None -> [T, N] in x's dtype."""
    tokens, k = x.shape
    experts, n, _ = qdata.shape
    out = torch.empty((tokens, n), dtype=x.dtype, device=x.device)  # every row is written
    if tokens == 0 or n == 0 or experts == 0:
        return out.zero_()
    config = config or _config(token_block(tokens, experts))
    config = dict(config)
    if INTERPRETED:
        config.update(num_stages=1)
    x_scale = x
    if config["PREQUANT"]:
        x, x_scale = act_quant_launch(x, group, ue8m0)
    bias_arg, stride_be = bias_args(bias, out)
    tile_grid = grid(n, tokens, experts, config["BLOCK_N"], config["BLOCK_M"])
    _fp8_kernel[tile_grid](
        x,
        x_scale,
        qdata,
        scale,
        bias_arg,
        out,
        offs,
        experts,
        tokens,
        n,
        k,
        x.stride(0),
        qdata.stride(0),
        qdata.stride(1),
        scale.stride(0),
        scale.stride(1),
        stride_be,
        out.stride(0),
        W_BLOCK_N=block_n,
        W_BLOCK_K=block_k,
        GROUP=group,
        UE8M0=ue8m0,
        EXACT_CAST=INTERPRETED,
        HAS_BIAS=bias is not None,
        EVEN_K=k % group == 0,
        E_POW2=triton.next_power_of_2(experts),
        **config,
    )
    return out
