"""The grouped 4-bit weight-only GEMV (decode: about one routed row per expert): the 2-D word
GEMV's step (`w4a16.gemv_words`) per routed row, `_gemv_kernel`: a program per (routed row,
weight band), the rows of an expert side by side so that its band is read from HBM once;
CUDA-core FMAs on the exact fp32 weights: within the activation dtype's rounding of the
reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..w4a16.decode import (
    FMT_MXFP4,
    group_scale,
    group_terms,
    halves_to_fp32,
    int4_nibble,
    load_global_scale,
    scale_arg,
    word_pair,
)

__all__ = ["config", "launch", "problem"]


def problem(fmt: int, k: int) -> str | None:
    """Why the GEMV cannot run, or None: it reads whole 32-bit words of codes per row."""
    return None if k % 8 == 0 else f"it reads whole 32-bit words of codes: K % 8 == 0, not {k}"


def config(k: int) -> dict:
    """16 weight rows x 64 words (512 K) per step on 2 warps where K / 8 is a multiple of 64,
    else 16 x 32 words on 1 warp (Qwen3's down, K = 768; gpt-oss, K = 2880, with a masked last
    step): the best of the H100 sweeps on the Qwen3-30B-A3B and gpt-oss-120b experts
    (docs/kernels/grouped.md, "Why these configs (H100 sweeps)")."""
    wide = (k // 8) % 64 == 0
    return {
        "KERNEL": "gemv",
        "BLOCK_N": 16,
        "BLOCK_W": 64 if wide else 32,
        "num_warps": 2 if wide else 1,
    }


@triton.jit
def _load_x(ptrs, ok, MASK_K: tl.constexpr):
    if MASK_K:
        return tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    else:
        return tl.load(ptrs).to(tl.float32)


@triton.jit
def _gemv_words_step(
    acc,
    group_acc,
    words,
    x_ptr,
    s_ptr,
    z_ptr,
    offs_n,
    n_ok,
    w0,
    KW,
    NG,
    stride_sn,
    FORMAT: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_W: tl.constexpr,
    MASK_K: tl.constexpr,
):
    """The 2-D word GEMV's step (`w4a16/gemv_words.py's `_gemv_words_kernel``) at word w0, `words`
    [BLOCK_N, BLOCK_W] already loaded: nibble plane j of every word decoded in place times the
    activations x[8w + j]; int4 adds each group's scaled terms to acc [BLOCK_N], e2m1 its group
    sums times their scales to group_acc [BLOCK_N, G] (value * 2**-14: the caller scales back).
    MASK_K: the last, partial step (its words past KW are zero codes, their activations 0)."""
    WG: tl.constexpr = GROUP // 8 if GROUP // 8 < BLOCK_W else BLOCK_W  # words per group
    G: tl.constexpr = BLOCK_W // WG  # groups per step
    BLOCK_N: tl.constexpr = words.shape[0]
    word = w0 + tl.arange(0, BLOCK_W)
    x_ptrs = x_ptr + word * 8
    x_ok = word < KW
    group = (w0 + tl.arange(0, G) * WG) // (GROUP // 8)
    g_ok = n_ok[:, None] & (group < NG)[None, :] if MASK_K else n_ok[:, None]
    scale, zero = group_scale(
        s_ptr, z_ptr, offs_n[:, None] * stride_sn + group[None, :], g_ok, FORMAT
    )
    partial = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
    if FORMAT >= FMT_MXFP4:
        for j in tl.static_range(4):
            low, high = halves_to_fp32(word_pair(words, j))
            x_low = _load_x(x_ptrs + j, x_ok, MASK_K)
            x_high = _load_x(x_ptrs + j + 4, x_ok, MASK_K)
            partial += low * x_low[None, :]
            partial += high * x_high[None, :]
        group_acc += tl.sum(tl.reshape(partial, (BLOCK_N, G, WG)), axis=2) * scale
    else:
        x_sum = tl.zeros((BLOCK_W,), dtype=tl.float32)
        for j in tl.static_range(8):
            xj = _load_x(x_ptrs + j, x_ok, MASK_K)
            partial += int4_nibble(words, j) * xj[None, :]
            x_sum += xj
        group_sum = tl.sum(tl.reshape(partial, (BLOCK_N, G, WG)), axis=2)
        group_x = tl.sum(tl.reshape(x_sum, (G, WG)), axis=1)[None, :]
        acc += tl.sum(group_terms(group_sum, group_x, scale, zero, FORMAT), axis=1)
    return acc, group_acc


@triton.jit
def _gemv_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    g_ptr,
    bias_ptr,
    out_ptr,
    offs_ptr,
    E,
    N,
    KW,
    stride_xm,
    stride_qe,
    stride_qw,
    stride_se,
    stride_sn,
    stride_ze,
    stride_be,
    stride_om,
    FORMAT: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    E_POW2: tl.constexpr,
):
    """Decode (a few rows per expert): out[row, n-band] for one routed row, the 2-D word GEMV
    (CUDA-core FMAs on the codes as 32-bit words; K a multiple of 8, q_ptr an int32 view) on
    the row's expert: the number of experts whose rows end at or before it (one load of offs,
    one sum). The rows are the grid's fast axis, so the rows of one expert run together and
    share its band through L2. A row past offs[-1] is written as zeros. Steps of BLOCK_W
    words, then a masked step when KW is not a multiple of it."""
    row = tl.program_id(0)
    idx = tl.arange(0, E_POW2)
    ends = tl.load(offs_ptr + idx, mask=idx < E, other=2**31 - 1)
    e = tl.sum((ends <= row).to(tl.int32), 0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    out_ptrs = out_ptr + row.to(tl.int64) * stride_om + offs_n
    if e < E:
        WG: tl.constexpr = GROUP // 8 if GROUP // 8 < BLOCK_W else BLOCK_W
        G: tl.constexpr = BLOCK_W // WG
        expert = e.to(tl.int64)
        q_ptr += expert * stride_qe
        s_ptr += expert * stride_se
        z_ptr += expert * stride_ze
        x_ptr += row.to(tl.int64) * stride_xm
        NG = tl.cdiv(KW * 8, GROUP)
        word = tl.arange(0, BLOCK_W)
        q_ptrs = q_ptr + offs_n[:, None] * stride_qw + word[None, :]
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        group_acc = tl.zeros((BLOCK_N, G), dtype=tl.float32)
        full = KW - KW % BLOCK_W
        words = tl.load(q_ptrs, mask=(offs_n < N * (full > 0))[:, None], other=0)
        for w0 in range(0, full, BLOCK_W):  # the codes loaded a step ahead (not a dot's loads)
            next_ok = offs_n < N * (w0 + BLOCK_W < full)  # (no rows past the last step)
            next_words = tl.load(q_ptrs + w0 + BLOCK_W, mask=next_ok[:, None], other=0)
            acc, group_acc = _gemv_words_step(
                acc,
                group_acc,
                words,
                x_ptr,
                s_ptr,
                z_ptr,
                offs_n,
                n_ok,
                w0,
                KW,
                NG,
                stride_sn,
                FORMAT,
                GROUP,
                BLOCK_W,
                False,
            )
            words = next_words
        if full < KW:
            k_ok = (full + word < KW)[None, :]
            words = tl.load(q_ptrs + full, mask=n_ok[:, None] & k_ok, other=0)
            acc, group_acc = _gemv_words_step(
                acc,
                group_acc,
                words,
                x_ptr,
                s_ptr,
                z_ptr,
                offs_n,
                n_ok,
                full,
                KW,
                NG,
                stride_sn,
                FORMAT,
                GROUP,
                BLOCK_W,
                True,
            )
        if FORMAT >= FMT_MXFP4:  # the decoded e2m1 values are value * 2**-14
            acc = tl.sum(group_acc, axis=1) * (load_global_scale(g_ptr + e, FORMAT) * 16384.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + e * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        tl.store(out_ptrs, tl.zeros((BLOCK_N,), out_ptr.dtype.element_ty), mask=n_ok)


def launch(
    fmt: int, x, offs, qdata, scale, zero, global_scale, bias, out, group: int, k: int, config: dict
) -> torch.Tensor:
    """out [T, N] for x [T, k] sorted by expert, one program per routed row and weight band."""
    assert problem(fmt, k) is None, problem(fmt, k)
    tokens = x.shape[0]
    experts, n, _ = qdata.shape
    config = {key: v for key, v in config.items() if key != "KERNEL"}
    zero_arg, stride_ze = (zero, zero.stride(0)) if zero.numel() else (qdata, 0)
    bias_arg, stride_be = (bias, bias.stride(0)) if bias is not None else (out, 0)
    words = qdata.view(torch.int32)  # 8 codes per word, element 8w + j at bits 4j
    _gemv_kernel[(tokens, triton.cdiv(n, config["BLOCK_N"]))](
        x,
        words,
        scale_arg(scale),
        zero_arg,
        global_scale,
        bias_arg,
        out,
        offs,
        experts,
        n,
        words.shape[2],
        x.stride(0),
        words.stride(0),
        words.stride(1),
        scale.stride(0),
        scale.stride(1),
        stride_ze,
        stride_be,
        out.stride(0),
        FORMAT=int(fmt),
        GROUP=group,
        HAS_BIAS=bias is not None,
        E_POW2=triton.next_power_of_2(experts),
        **config,
    )
    return out
