"""The byte GEMV: one token (decode) on any K, `_gemv_kernel` streaming a band of weight rows
BLOCK_K values at a time. The op runs it at one token where K is not a multiple of the word
GEMV's step (`gemv_words.py`, which is faster where it runs; `select.py`).

It multiplies the exact weight, not the weight rounded to the activation dtype as the reference
does: within the activation dtype's rounding for bf16/fp16 (the tests' tolerance). For fp32
activations the int4 zero-point term, 16 * sum v x - (16 + z) * sum x, cancels and costs a few
fp32 ulps of the group sums (up to ~1e-5 relative on activations with a large mean).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode import (
    FMT_MXFP4,
    decode_bytes,
    group_terms,
    launch_args,
    load_global_scale,
    step_codes,
)
from .format import Format

__all__ = ["config", "launch", "problem"]


def problem(fmt: int, x: torch.Tensor, qdata: torch.Tensor, group: int) -> str | None:
    """None: the byte GEMV runs every format, group and K (any number of tokens, one program
    per token and row band)."""
    return None


@triton.jit
def _gemv_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    g_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    KH,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_om,
    FORMAT: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[m, n-band] for one token m, streaming the band's codes BLOCK_K values at a time.

    Each group's scale is applied to the group's sum, not to each weight (as the FP8 GEMV
    does), so a weight costs its decoding (`decode_bytes`: a shift and a mask or two) and one FMA:
    int4 sum (u - z) s x = s * (16 * sum v x - (16 + z) * sum x) with v = 1 + u/16;
    e2m1 sum v' s x * 2**14 with v' = value * 2**-14."""
    pid = tl.program_id(0)
    m = pid % M  # the programs of one weight band run together and share it through L2
    offs_n = (pid // M) * BLOCK_N + tl.arange(0, BLOCK_N)
    GK: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K  # values of one group in a step
    G: tl.constexpr = BLOCK_K // GK
    x_ptr += m * stride_xm
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    packed, scale, zero = step_codes(
        q_ptr,
        s_ptr,
        z_ptr,
        offs_n,
        0,
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
    x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0)
    for k0 in range(0, K, BLOCK_K):
        next_packed, next_scale, next_zero = step_codes(
            q_ptr,
            s_ptr,
            z_ptr,
            offs_n,
            k0 + BLOCK_K,
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
        next_x = tl.load(x_ptr + k0 + BLOCK_K + offs_k, mask=k0 + BLOCK_K + offs_k < K, other=0.0)
        xf = x.to(tl.float32)
        products = decode_bytes(packed, FORMAT) * xf[None, :]
        partial = tl.sum(tl.reshape(products, (BLOCK_N, G, GK)), axis=2)  # [BLOCK_N, G]
        if FORMAT >= FMT_MXFP4:
            acc += tl.sum(partial * scale, axis=1)
        else:
            x_sum = tl.sum(tl.reshape(xf, (G, GK)), axis=1)[None, :]
            acc += tl.sum(group_terms(partial, x_sum, scale, zero, FORMAT), axis=1)
        packed, scale, zero, x = next_packed, next_scale, next_zero, next_x
    total = acc * load_global_scale(g_ptr, FORMAT)
    if FORMAT >= FMT_MXFP4:
        total = total * 16384.0  # the decoded e2m1 values are value * 2**-14
    n_ok = offs_n < N
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


def config(fmt: Format) -> dict:
    """1024 K (a 512-byte strip per row) per step; 16 rows (8 for NVFP4, whose 16-groups load
    twice the scales). The best of the H200 sweep (docs/kernels/w4a16.md): 77 / 90 / 101 us
    for the Llama-3.1-8B layer in int4 g128 / MXFP4 / NVFP4 at M = 1."""
    rows = 8 if fmt == Format.NVFP4 else 16
    return {"BLOCK_N": rows, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 1}


def launch(
    fmt: int, x, qdata, scale, zero, bias, out, group: int, config: dict, global_scale
) -> torch.Tensor:
    """out [M, N] = x [M, K] @ W.T + bias, one program per token and band of BLOCK_N rows."""
    m, k = x.shape
    n = qdata.shape[0]
    config = {key: v for key, v in config.items() if key != "KERNEL"}
    args, common = launch_args(fmt, x, qdata, scale, zero, global_scale, bias, out, group)
    grid = (triton.cdiv(n, config["BLOCK_N"]) * m,)
    _gemv_kernel[grid](
        *args,
        m,
        n,
        k,
        qdata.shape[1],
        x.stride(0),
        qdata.stride(0),
        scale.stride(0),
        out.stride(0),
        EVEN_K=k % config["BLOCK_K"] == 0,
        **common,
        **config,
    )
    return out
