"""The FP8 blockwise GEMV (one token, decode), with the activation quantization fused: each
program quantizes the activation row in registers (cheap: one row) and streams a narrow band of
weight rows several groups per step, so that enough programs and enough bytes are in flight to
read the weights at HBM speed; each group's partial sums are reduced in fp32 and promoted with
their scales as in the GEMM. Each token re-reads the weights (from L2): on an H200 the Llama
layer took 73 us at one token but 169 us at 4, where cuBLAS takes ~100 (`select.py`).

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

from .act_quant import INTERPRETED, quantize_rows

__all__ = ["config", "launch", "problem"]


def problem(
    x: torch.Tensor, qdata: torch.Tensor, block_n: int, block_k: int, group: int
) -> str | None:
    """None: the GEMV runs every block and group size."""
    return None


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_wsn,
    stride_om,
    W_BLOCK_N: tl.constexpr,
    W_BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    UE8M0: tl.constexpr,
    EXACT_CAST: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS_PER_STEP: tl.constexpr,
):
    """out[m, n-band] for one token m: quantize x[m] per group in registers, stream the band's
    weights GROUPS_PER_STEP groups at a time, reduce each group's products in fp32."""
    pid = tl.program_id(0)
    m = pid % M  # the programs of one weight band run together and share it through L2
    offs_n = (pid // M) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    STEP: tl.constexpr = GROUP * GROUPS_PER_STEP
    offs_k = tl.arange(0, STEP)
    offs_g = tl.arange(0, GROUPS_PER_STEP)
    x_ptrs = x_ptr + m * stride_xm + offs_k
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    w_scale_ptrs = w_scale_ptr + (offs_n // W_BLOCK_N)[:, None] * stride_wsn
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, STEP):
        if EVEN_K:
            x = tl.load(x_ptrs).to(tl.float32)
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            g_ok = offs_g < GROUPS_PER_STEP
        else:
            k_ok = offs_k < K - k0
            x = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            g_ok = offs_g < tl.cdiv(K - k0, GROUP)
        rows = tl.reshape(x, (GROUPS_PER_STEP, GROUP))
        xq, x_scale = quantize_rows(rows, UE8M0, EXACT_CAST, False)
        products = w.to(tl.float32) * tl.reshape(xq.to(tl.float32), (STEP,))[None, :]
        partial = tl.sum(tl.reshape(products, (BLOCK_N, GROUPS_PER_STEP, GROUP)), axis=2)
        w_scale = tl.load(
            w_scale_ptrs + (k0 + offs_g * GROUP)[None, :] // W_BLOCK_K,
            mask=n_ok[:, None] & g_ok[None, :],
            other=0.0,
        )
        acc += tl.sum(partial * (x_scale[None, :] * w_scale), axis=1)
        x_ptrs += STEP
        w_ptrs += STEP
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def config(m: int, n: int, k: int, group: int) -> dict:
    """A narrow band of weight rows per program (many programs), 1024 K per step: the best of
    the H200 sweeps (8 rows x 8 groups of 128: 69-74 us for the Llama layer at M = 1)."""
    return {"BLOCK_N": 8, "GROUPS_PER_STEP": max(1, 1024 // group), "num_warps": 4, "num_stages": 3}


def launch(
    x, qdata, scale, bias, out, block_n: int, block_k: int, group: int, ue8m0: bool, config: dict
) -> torch.Tensor:
    """out [M, N] = x @ W.T + bias, one program per token and band of BLOCK_N rows."""
    m, k = x.shape
    n = qdata.shape[0]
    step = group * config["GROUPS_PER_STEP"]
    grid = (triton.cdiv(n, config["BLOCK_N"]) * m,)
    _gemv_kernel[grid](
        x,
        qdata,
        scale,
        bias if bias is not None else out,
        out,
        m,
        n,
        k,
        x.stride(0),
        qdata.stride(0),
        scale.stride(0),
        out.stride(0),
        W_BLOCK_N=block_n,
        W_BLOCK_K=block_k,
        GROUP=group,
        HAS_BIAS=bias is not None,
        UE8M0=ue8m0,
        EXACT_CAST=INTERPRETED,
        EVEN_K=k % step == 0,
        **config,
    )
    return out
