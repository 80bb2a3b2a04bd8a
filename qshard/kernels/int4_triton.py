"""Int4 weight-only (W4A16) kernels in Triton.

- Up to FUSED_MAX_M tokens, a fused kernel in the shape of the FP8 small-M kernel: "swap AB"
  (weight rows on the MMA's M side, the tokens, padded to 16..128, on its N side), the K steps
  split over programs so that a 4096-wide layer still fills every SM (`split_k.py`). Each step
  unpacks BLOCK_K 4-bit codes per row in registers (even index in the low nibble), dequantizes
  `(u - zero) * scale` in fp32 with one scale and zero per (row, group), rounds the weight to the
  activation dtype (what the reference multiplies) and accumulates `tl.dot` in fp32.
- Above, the weight is dequantized once into the activation dtype by a Triton kernel and cuBLAS
  multiplies (`F.linear`): at large M the matmul is compute-bound, and a bf16 weight costs one
  extra pass over 2 bytes per weight (issue 6 asks for whichever is faster: to be measured).

Op: `torch.ops.qshard.int4_linear` (fake implementation beside it); reference: `int4.py`. Tested
against the reference under the Triton interpreter (float16 activations, facts.md §3) and on an
H200 (v1 kernels). v1 (a GEMV and an unswapped tl.dot GEMM, scales gathered per value) measured
0.03-0.21x of bf16 on an H200 (docs/kernels/int4.md); this v2 is not yet measured, so
`backend="auto"` does not pick the kernels; `backend="triton"` does.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .split_k import finish_tile, split_count, workspace

__all__ = ["int4_linear", "linear_launch", "small_m_config"]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Up to this many tokens the fused kernel, dequantize + cuBLAS above (not yet tuned on a GPU).
FUSED_MAX_M = 128
MIN_STEPS_PER_SPLIT = 4


@triton.jit
def _dequantized_tile(
    q_ptr, s_ptr, z_ptr, offs_n, k0, N, K, stride_qn, stride_sn,
    GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """W[offs_n, k0:k0+BLOCK_K] as fp32, unpacked and dequantized (0 outside the weight). k0 is
    a multiple of min(BLOCK_K, GROUP): the tile spans G whole groups, or lies in one group.
    Scales and zeros are loaded once per (row, group) and broadcast over the group's values."""
    G: tl.constexpr = BLOCK_K // GROUP if BLOCK_K >= GROUP else 1
    offs_h = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    n_ok = offs_n < N
    packed = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_h[None, :],
                     mask=n_ok[:, None] & (offs_h[None, :] < (K + 1) // 2), other=0)  # fmt: skip
    u = tl.reshape(tl.join(packed & 0x0F, packed >> 4), (offs_n.shape[0], G, BLOCK_K // G))
    offs_g = k0 // GROUP + tl.arange(0, G)
    g_ok = n_ok[:, None] & (offs_g[None, :] < tl.cdiv(K, GROUP))
    group_ptrs = offs_n[:, None] * stride_sn + offs_g[None, :]
    scale = tl.load(s_ptr + group_ptrs, mask=g_ok, other=0.0).to(tl.float32)
    if SYMMETRIC:  # a constexpr branch: the zero-point load is not traced
        zero = tl.full(scale.shape, 8.0, tl.float32)
    else:
        zero = tl.load(z_ptr + group_ptrs, mask=g_ok, other=0.0).to(tl.float32)
    w = (u.to(tl.float32) - zero[:, :, None]) * scale[:, :, None]
    w = tl.reshape(w, (offs_n.shape[0], BLOCK_K))
    offs_k = k0 + tl.arange(0, BLOCK_K)
    return tl.where(offs_k[None, :] < K, w, 0.0)  # past K (a partial last group): 0, not -z*s


@triton.jit
def _fused_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, partials_ptr, arrived_ptr,
    M, N, K, steps_per_split, stride_xm, stride_qn, stride_sn, stride_om,
    GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, HAS_BIAS: tl.constexpr, X_FP32: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out.T[n-tile, m-tile] = W[n-tile] @ x[m-tile].T over this program's K steps."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first_step = tl.program_id(1) * steps_per_split
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok, m_ok = offs_n < N, offs_m < M
    last_step = tl.minimum(first_step + steps_per_split, tl.cdiv(K, BLOCK_K))
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for step in range(first_step, last_step):
        k0 = step * BLOCK_K
        w = _dequantized_tile(q_ptr, s_ptr, z_ptr, offs_n, k0, N, K, stride_qn, stride_sn,
                              GROUP, SYMMETRIC, BLOCK_K)  # fmt: skip
        w = w.to(x_ptr.dtype.element_ty)  # the weight in the activation dtype, as the reference
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & (offs_k[None, :] < K), other=0.0)  # fmt: skip
        if X_FP32:  # fp32 activations: a true fp32 product, not TF32
            acc += tl.dot(w, tl.trans(x), input_precision="ieee")
        else:
            acc += tl.dot(w, tl.trans(x))
    finish_tile(acc, partials_ptr, arrived_ptr, bias_ptr, out_ptr, offs_n, offs_m, n_ok, m_ok, M, N,
                stride_om, HAS_BIAS, SPLIT)  # fmt: skip


@triton.jit
def _dequantize_kernel(
    q_ptr, s_ptr, z_ptr, w_ptr, N, K, stride_qn, stride_sn, stride_wn,
    GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """W [N, K] in w's dtype, each value rounded once from fp32 (as the reference)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w = _dequantized_tile(q_ptr, s_ptr, z_ptr, offs_n, k0, N, K, stride_qn, stride_sn,
                          GROUP, SYMMETRIC, BLOCK_K)  # fmt: skip
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    tl.store(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
             w.to(w_ptr.dtype.element_ty), mask=mask)  # fmt: skip


def small_m_config(m: int, n: int, k: int, group: int, device: torch.device) -> dict:
    """Tiles of 64 weight rows x the tokens (16..128), 128 K per step, split over ~2 programs
    per SM. A first guess from the FP8 kernel's sweep: not yet tuned for int4 on a GPU."""
    block_n, block_m, block_k = 64, min(128, max(16, triton.next_power_of_2(m))), 128
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = split_count(tiles, triton.cdiv(k, block_k), MIN_STEPS_PER_SPLIT, 2, device)
    return {"BLOCK_N": block_n, "BLOCK_M": block_m, "BLOCK_K": block_k, "SPLIT_K": split,
            "num_warps": 4, "num_stages": 3}  # fmt: skip


def dequantize_launch(qdata, scale, zero, group: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    n = qdata.shape[0]
    w = torch.empty((n, k), dtype=dtype, device=qdata.device)
    symmetric = zero.numel() == 0
    block_n, block_k = 32, 128
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _dequantize_kernel[grid](
        qdata, scale, scale if symmetric else zero, w, n, k,
        qdata.stride(0), scale.stride(0), w.stride(0),
        GROUP=group, SYMMETRIC=symmetric, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return w


def linear_launch(x, qdata, scale, zero, bias, group: int, config: dict | None = None):
    """x [M, K] -> x @ W.T + bias [M, N] in x's dtype: the fused kernel up to FUSED_MAX_M tokens
    (or when `config` is given), else dequantize + F.linear."""
    m, k = x.shape
    n = qdata.shape[0]
    if m > FUSED_MAX_M and config is None:
        weight = dequantize_launch(qdata, scale, zero, group, k, x.dtype)
        return F.linear(x, weight, bias.to(x.dtype) if bias is not None else None)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    config = dict(config or small_m_config(m, n, k, group, x.device))
    if INTERPRETED:  # the interpreter runs one program at a time, sequentially
        config.update(num_stages=1)
    steps = triton.cdiv(k, config["BLOCK_K"])
    steps_per_split = triton.cdiv(steps, min(config.pop("SPLIT_K"), max(steps, 1)))
    split = triton.cdiv(steps, steps_per_split) if steps else 1
    grid = (triton.cdiv(n, config["BLOCK_N"]), split, triton.cdiv(m, config["BLOCK_M"]))
    tiles = grid[0] * grid[2]
    partials, arrived = workspace(m, n, split, tiles, x.device) if split > 1 else (out, out)
    symmetric = zero.numel() == 0
    # The reference adds the bias rounded to the activation dtype; the epilogue adds it in fp32.
    bias = bias.to(x.dtype) if bias is not None else None
    _fused_kernel[grid](
        x, qdata, scale, scale if symmetric else zero, bias if bias is not None else out, out,
        partials, arrived, m, n, k, steps_per_split,
        x.stride(0), qdata.stride(0), scale.stride(0), out.stride(0),
        GROUP=group, SYMMETRIC=symmetric, HAS_BIAS=bias is not None,
        X_FP32=x.dtype == torch.float32, SPLIT=split > 1, **config,
    )  # fmt: skip
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
