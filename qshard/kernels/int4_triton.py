"""Int4 weight-only (W4A16) kernels in Triton: a GEMV for decode and a tensor-core GEMM.

Both unpack the 4-bit codes in registers (even index in the low nibble), dequantize
`(u - zero) * scale` in fp32, round the weight to the activation dtype (what the reference
multiplies), and accumulate in fp32. Op: `torch.ops.qshard.int4_linear` (fake implementation
beside it); reference: `int4.py`. Tested against the reference under the Triton interpreter
(float16 activations, facts.md §3). Not yet measured or tuned on a GPU, so `backend="auto"`
does not pick them; `backend="triton"` does.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["int4_linear"]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
GEMV_MAX_M = 1


@triton.jit
def _dequantized_tile(
    q_ptr,
    s_ptr,
    z_ptr,
    offs_n,
    k0,
    N,
    K,
    stride_qn,
    stride_sn,
    GROUP: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """W[offs_n, k0:k0+BLOCK_K] as fp32, unpacked and dequantized (0 outside the weight)."""
    offs_h = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    n_ok = offs_n < N
    packed = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_h[None, :],
                     mask=n_ok[:, None] & (offs_h[None, :] < (K + 1) // 2), other=0)  # fmt: skip
    u = tl.reshape(tl.join(packed & 0x0F, packed >> 4), (offs_n.shape[0], BLOCK_K))
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_ok = n_ok[:, None] & (offs_k[None, :] < K)
    group_ptrs = offs_n[:, None] * stride_sn + offs_k[None, :] // GROUP
    scale = tl.load(s_ptr + group_ptrs, mask=k_ok, other=0.0).to(tl.float32)
    if SYMMETRIC:  # noqa: SIM108 (a constexpr branch: the load must not be traced)
        zero = 8.0
    else:
        zero = tl.load(z_ptr + group_ptrs, mask=k_ok, other=0.0).to(tl.float32)
    return (u.to(tl.float32) - zero) * scale


@triton.jit
def _gemv_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, M, N, K,
    stride_xm, stride_qn, stride_sn, stride_om,
    GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    m = pid % M
    offs_n = (pid // M) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = _dequantized_tile(q_ptr, s_ptr, z_ptr, offs_n, k0, N, K, stride_qn, stride_sn,
                              GROUP, SYMMETRIC, BLOCK_K)  # fmt: skip
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m * stride_xm + offs_k, mask=offs_k < K, other=0.0)
        w = w.to(x_ptr.dtype.element_ty).to(tl.float32)  # the weight in the activation dtype
        acc += tl.sum(w * x.to(tl.float32)[None, :], axis=1)
    n_ok = offs_n < N
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0)
        acc += bias.to(x_ptr.dtype.element_ty).to(tl.float32)  # rounded as the reference
    tl.store(out_ptr + m * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _gemm_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, M, N, K,
    stride_xm, stride_qn, stride_sn, stride_om,
    GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, X_FP32: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)  # fmt: skip
        w = _dequantized_tile(q_ptr, s_ptr, z_ptr, offs_n, k0, N, K, stride_qn, stride_sn,
                              GROUP, SYMMETRIC, BLOCK_K)  # fmt: skip
        w_t = tl.trans(w.to(x_ptr.dtype.element_ty))
        if X_FP32:  # fp32 activations: a true fp32 product, not TF32
            acc += tl.dot(x, w_t, input_precision="ieee")
        else:
            acc += tl.dot(x, w_t)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc += bias.to(x_ptr.dtype.element_ty).to(tl.float32)[None, :]  # as the reference
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def linear_launch(x, qdata, scale, zero, bias, group: int) -> torch.Tensor:
    m, k = x.shape
    n = qdata.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    symmetric = zero.numel() == 0
    args = (
        x, qdata, scale, scale if symmetric else zero, bias if bias is not None else out, out,
        m, n, k, x.stride(0), qdata.stride(0), scale.stride(0), out.stride(0),
    )  # fmt: skip
    flags = dict(GROUP=group, SYMMETRIC=symmetric, HAS_BIAS=bias is not None)
    stages = 1 if INTERPRETED else 3
    if m <= GEMV_MAX_M:
        block_n = 16
        grid = (triton.cdiv(n, block_n) * m,)
        _gemv_kernel[grid](*args, **flags, BLOCK_N=block_n, BLOCK_K=256, num_stages=stages)
    else:
        block_m = 16 if m <= 16 else 64
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
        _gemm_kernel[grid](*args, **flags, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64,
                           X_FP32=x.dtype == torch.float32, num_stages=stages)  # fmt: skip
    return out


@torch.library.custom_op("qshard::int4_linear", mutates_args=())
def int4_linear(
    x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
    bias: torch.Tensor | None, group: int,
) -> torch.Tensor:  # fmt: skip
    """y = x @ W.T + bias for x [..., K] and the int4 weight (qdata, scale, zero)."""
    k, n = x.shape[-1], qdata.shape[0]
    x2d = x.reshape(-1, k).contiguous()
    bias = bias.contiguous() if bias is not None else None  # the kernels read it with stride 1
    out = linear_launch(x2d, qdata.contiguous(), scale.contiguous(), zero.contiguous(), bias,
                        group)  # fmt: skip
    return out.reshape(*x.shape[:-1], n)


@int4_linear.register_fake
def _(x, qdata, scale, zero, bias, group):
    return x.new_empty((*x.shape[:-1], qdata.shape[0]))
