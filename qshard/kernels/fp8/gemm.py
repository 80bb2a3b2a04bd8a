"""The FP8 blockwise tensor-core GEMM in Triton, after the act-quant kernel: where cuBLAS cannot
take the layout (re-blocked 64-blocks, partial edge blocks, sm_89) above 64 tokens.

GEMM: y[m, n] = sum over activation groups g of
    (sum_{k in g} xq[m, k] * wq[n, k]) * (x_scale[m, g] * w_scale[n // bn, k // bk])
The fp8 dot of one group is accumulated by the tensor cores (or CUDA cores), then promoted to
fp32 with its scales (DeepSeek-V3 §3.3.2), so the K step is the activation group (128, or 64
after re-blocking). Runs on the GPU (sm_89+: Triton's fp8 dot), and on the CPU under
TRITON_INTERPRET=1 for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .act_quant import act_quant_launch

__all__ = ["config", "launch", "problem"]


def problem(
    x: torch.Tensor, qdata: torch.Tensor, block_n: int, block_k: int, group: int
) -> str | None:
    """None: the GEMM runs every block and group size."""
    return None


@triton.jit
def _gemm_kernel(
    a_ptr,
    a_scale_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_am,
    stride_wn,
    stride_wsn,
    stride_om,
    W_BLOCK_N: tl.constexpr,
    W_BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped tile order: GROUP_M row tiles share each weight tile while it is in L2.
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * tiles_n)) * GROUP_M
    group_rows = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_rows
    pid_n = (pid % (GROUP_M * tiles_n)) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, GROUP)
    m_ok, n_ok = offs_m < M, offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    w_scale_ptrs = w_scale_ptr + (offs_n // W_BLOCK_N) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, tl.cdiv(K, GROUP)):
        if EVEN_K:
            a_mask, w_mask = m_ok[:, None], n_ok[:, None]
        else:
            k_ok = offs_k < K - g * GROUP
            a_mask, w_mask = m_ok[:, None] & k_ok[None, :], n_ok[:, None] & k_ok[None, :]
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        a_scale = tl.load(a_scale_ptr + g * M + offs_m, mask=m_ok, other=0.0)
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        w_scale = tl.load(w_scale_ptrs + (g * GROUP) // W_BLOCK_K, mask=n_ok, other=0.0)
        partial = tl.dot(a, tl.trans(w))
        acc += partial * (a_scale[:, None] * w_scale[None, :])
        a_ptrs += GROUP
        w_ptrs += GROUP
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def config(m: int, n: int, k: int) -> dict:
    """Tensor-core tiles by M; from the H200 sweep (bench/bench_fp8.py --sweep, bench/README.md)."""
    if m <= 64:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}
    if m <= 256:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}


def launch(
    x, qdata, scale, bias, out, block_n: int, block_k: int, group: int, ue8m0: bool, config: dict
) -> torch.Tensor:
    """out [M, N] = x @ W.T + bias: the act-quant kernel, then the tiles of `config`."""
    m, k = x.shape
    n = qdata.shape[0]
    a, a_scale = act_quant_launch(x, group, ue8m0)
    grid = (triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"]),)
    _gemm_kernel[grid](
        a,
        a_scale,
        qdata,
        scale,
        bias if bias is not None else out,
        out,
        m,
        n,
        k,
        a.stride(0),
        qdata.stride(0),
        scale.stride(0),
        out.stride(0),
        W_BLOCK_N=block_n,
        W_BLOCK_K=block_k,
        GROUP=group,
        HAS_BIAS=bias is not None,
        EVEN_K=k % group == 0,
        **config,
    )
    return out
