"""Grouped (mixture-of-experts) matmul kernels in Triton: one launch over every expert.

The tokens x [T, K] are sorted by expert; offs [E] int32 holds the end row of each expert's tokens
(transformers' grouped_mm convention, docs/design.md, "Experts in transformers"). out[rows of e] =
x[rows of e] @ W[e].T (+ bias[e]) for [E, N, K] experts; rows past offs[-1] are zeros. Their
definition is the per-expert 2-D reference (qshard/qtensor/grouped.py); tests compare against it.

Work split: the rows of each expert are cut into blocks of BLOCK_M tokens; a program takes one
(BLOCK_N weight rows, token block) tile, "swap AB" as the 2-D small-M kernels: the weight rows
are the MMA's M side (64+ rows fill a wgmma) and the few tokens of an expert its N side. Which
expert and rows a token-block index stands for is found in the kernel (`_expert_block`: a
cumulative sum of the experts' block counts from offs), so the launch needs no host sync and
no index tensors: its grid is the upper bound cdiv(T, BLOCK_M) + E token blocks (each expert
wastes at most one partial block) and the programs past the last block return at once. Every
row index is also masked against T, so offsets that do not hold (decreasing, past T) never
reach memory outside x and out (the reference path refuses them with a typed error).

- FP8 blockwise W8A8 (`fp8_grouped_launch`): the activations quantized per 1 x GROUP group
  once beforehand by the act-quant kernel (PREQUANT, the default: measured faster at every
  size, `fp8_grouped_config`), or in registers by each tile (`_quantize_rows`); each group's
  fp8 dot is promoted with its scales in fp32 (DeepSeek-V3 §3.3.2), as
  `fp8_blockwise_triton.py`.
- 4-bit weight-only (int4, MXFP4, NVFP4: `w4a16_grouped_launch`): the 2-D small-M kernel's
  steps (`_small_m_step`, `_small_m_mma`: codes decoded by bit placement, weights rounded to the
  activation dtype as the reference). At decode (up to GEMV_MAX_ROWS_PER_EXPERT = 1 routed
  row per expert on average, K a multiple of 8; `w4a16_grouped_config`) the 2-D word GEMV's
  step instead
  (`_w4a16_grouped_gemv_kernel`: a program per routed row and weight band, CUDA-core FMAs on
  the exact fp32 weights, as `w4a16_triton._gemv_words_kernel`: within the activation dtype's
  rounding of the reference). Dequantizing the experts for bf16 `_grouped_mm` at prefill was
  measured slower (docs/kernels/grouped.md) and is not a path here.

Token block size: from the mean tokens per expert, T / E (uniform routing), between 16 (decode:
one block per hit expert, so each hit expert's weights are read once) and 128 (prefill).
Runs on CUDA GPUs (the FP8 kernel sm_89+, the 4-bit one sm_80+), and under TRITON_INTERPRET=1
on the CPU for tests.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .fp8_blockwise_triton import _quantize_rows, act_quant_launch
from .w4a16_triton import (
    _MXFP4,
    Format,
    _global_scale,
    _group_scale,
    _group_terms,
    _halves_to_fp32,
    _int4_nibble,
    _scale_arg,
    _small_m_mma,
    _small_m_step,
    _word_pair,
)

__all__ = [
    "fp8_grouped_config",
    "fp8_grouped_launch",
    "token_block",
    "w4a16_grouped_config",
    "w4a16_grouped_launch",
]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
GEMV_MAX_ROWS_PER_EXPERT = 1  # mean routed rows per expert up to which the 4-bit GEMV runs


@triton.jit
def _expert_block(offs_ptr, E, T, pid_m, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """(expert, first row, end row, live) of token block `pid_m` (blocks numbered expert by
    expert, each expert's rows cut into BLOCK_M). Past the last block (live False): the tail
    rows past offs[-1] that block pid_m - blocks zeroes (first row, end row), expert E."""
    idx = tl.arange(0, E_POW2)
    ends = tl.load(offs_ptr + idx, mask=idx < E, other=0)
    starts = tl.load(offs_ptr + idx - 1, mask=(idx >= 1) & (idx < E), other=0)
    counts = tl.maximum(tl.where(idx < E, ends - starts, 0), 0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(blocks, 0)
    e = tl.sum((cum <= pid_m).to(tl.int32), 0)  # the first expert whose blocks reach past pid_m
    mine = idx == e
    block = pid_m - tl.sum(tl.where(mine, cum - blocks, 0), 0)  # its index within the expert
    first = tl.sum(tl.where(mine, starts, 0), 0) + block * BLOCK_M
    end = tl.minimum(tl.sum(tl.where(mine, ends, 0), 0), T)
    if e >= E:  # a tail block: rows offs[-1] + (pid_m - all blocks) * BLOCK_M onwards
        routed = tl.max(tl.where(idx < E, ends, 0), 0)
        first = routed + (pid_m - tl.sum(blocks, 0)) * BLOCK_M
        end = T
    return e, first, end, e < E


@triton.jit
def _fp8_grouped_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, offs_ptr,
    E, T, N, K, stride_xm, stride_we, stride_wn, stride_wse, stride_wsn, stride_be, stride_om,
    W_BLOCK_N: tl.constexpr, W_BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    UE8M0: tl.constexpr, EXACT_CAST: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    PREQUANT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr,
):  # fmt: skip
    """out.T[n-tile, token block] = W[e][n-tile] @ xq[block].T, group by group."""
    e, first, end, live = _expert_block(offs_ptr, E, T, tl.program_id(1), BLOCK_M, E_POW2)
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
                xq, x_scale = _quantize_rows(x, UE8M0, EXACT_CAST, False)
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
            w_scale = tl.load(w_scale_ptrs + (g * GROUP) // W_BLOCK_K, mask=n_ok, other=0.0)
            acc += tl.dot(w, tl.trans(xq)) * (w_scale[:, None] * x_scale[None, :])
            x_ptrs += GROUP
            w_ptrs += GROUP
        _store_tile(acc, bias_ptr, out_ptr, e, offs_n, offs_m, n_ok, m_ok, stride_be, stride_om,
                    HAS_BIAS)  # fmt: skip
    else:
        _zero_tail(out_ptr, first, end, N, stride_om, BLOCK_N, BLOCK_M)


@triton.jit
def _w4a16_grouped_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, out_ptr, offs_ptr,
    E, T, N, K, KH, stride_xm, stride_qe, stride_qn, stride_se, stride_sn, stride_ze,
    stride_be, stride_om,
    FORMAT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    X_FP32: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    E_POW2: tl.constexpr,
):  # fmt: skip
    """out.T[n-tile, token block] = W[e][n-tile] @ x[block].T, BLOCK_K of K per step."""
    e, first, end, live = _expert_block(offs_ptr, E, T, tl.program_id(1), BLOCK_M, E_POW2)
    if live:
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = first + tl.arange(0, BLOCK_M)
        m_ok = (offs_m < end) & (offs_m >= 0)
        expert = e.to(tl.int64)
        q_ptr += expert * stride_qe
        s_ptr += expert * stride_se
        z_ptr += expert * stride_ze
        global_scale = _global_scale(g_ptr + e, FORMAT)
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm + offs_k[:, None]  # x.T
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for step in range(0, tl.cdiv(K, BLOCK_K)):
            k0 = step * BLOCK_K
            codes, scale, zero = _small_m_step(q_ptr, s_ptr, z_ptr, offs_n, k0, N, K, KH,
                                               stride_qn, stride_sn, FORMAT, GROUP, BLOCK_K,
                                               EVEN_K)  # fmt: skip
            x = tl.load(x_ptrs + k0, mask=m_ok[None, :] & (k0 + offs_k < K)[:, None], other=0.0)
            acc = _small_m_mma(acc, codes, scale, zero, x, global_scale, FORMAT, GROUP, BLOCK_K,
                               EVEN_K, X_FP32)  # fmt: skip
        _store_tile(acc, bias_ptr, out_ptr, e, offs_n, offs_m, offs_n < N, m_ok, stride_be,
                    stride_om, HAS_BIAS)  # fmt: skip
    else:
        _zero_tail(out_ptr, first, end, N, stride_om, BLOCK_N, BLOCK_M)


@triton.jit
def _load_x(ptrs, ok, MASK_K: tl.constexpr):
    if MASK_K:
        return tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    else:
        return tl.load(ptrs).to(tl.float32)


@triton.jit
def _gemv_words_step(acc, group_acc, words, x_ptr, s_ptr, z_ptr, offs_n, n_ok, w0, KW, NG,
                     stride_sn, FORMAT: tl.constexpr, GROUP: tl.constexpr,
                     BLOCK_W: tl.constexpr, MASK_K: tl.constexpr):  # fmt: skip
    """The 2-D word GEMV's step (`w4a16_triton._gemv_words_kernel`) at word w0, `words`
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
    scale, zero = _group_scale(s_ptr, z_ptr, offs_n[:, None] * stride_sn + group[None, :], g_ok,
                               FORMAT)  # fmt: skip
    partial = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
    if FORMAT >= _MXFP4:
        for j in tl.static_range(4):
            low, high = _halves_to_fp32(_word_pair(words, j))
            x_low = _load_x(x_ptrs + j, x_ok, MASK_K)
            x_high = _load_x(x_ptrs + j + 4, x_ok, MASK_K)
            partial += low * x_low[None, :]
            partial += high * x_high[None, :]
        group_acc += tl.sum(tl.reshape(partial, (BLOCK_N, G, WG)), axis=2) * scale
    else:
        x_sum = tl.zeros((BLOCK_W,), dtype=tl.float32)
        for j in tl.static_range(8):
            xj = _load_x(x_ptrs + j, x_ok, MASK_K)
            partial += _int4_nibble(words, j) * xj[None, :]
            x_sum += xj
        group_sum = tl.sum(tl.reshape(partial, (BLOCK_N, G, WG)), axis=2)
        group_x = tl.sum(tl.reshape(x_sum, (G, WG)), axis=1)[None, :]
        acc += tl.sum(_group_terms(group_sum, group_x, scale, zero, FORMAT), axis=1)
    return acc, group_acc


@triton.jit
def _w4a16_grouped_gemv_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, out_ptr, offs_ptr,
    E, N, KW, stride_xm, stride_qe, stride_qw, stride_se, stride_sn, stride_ze,
    stride_be, stride_om,
    FORMAT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, E_POW2: tl.constexpr,
):  # fmt: skip
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
            acc, group_acc = _gemv_words_step(acc, group_acc, words, x_ptr, s_ptr, z_ptr,
                                              offs_n, n_ok, w0, KW, NG, stride_sn, FORMAT,
                                              GROUP, BLOCK_W, False)  # fmt: skip
            words = next_words
        if full < KW:
            k_ok = (full + word < KW)[None, :]
            words = tl.load(q_ptrs + full, mask=n_ok[:, None] & k_ok, other=0)
            acc, group_acc = _gemv_words_step(acc, group_acc, words, x_ptr, s_ptr, z_ptr,
                                              offs_n, n_ok, full, KW, NG, stride_sn, FORMAT,
                                              GROUP, BLOCK_W, True)  # fmt: skip
        if FORMAT >= _MXFP4:  # the decoded e2m1 values are value * 2**-14
            acc = tl.sum(group_acc, axis=1) * (_global_scale(g_ptr + e, FORMAT) * 16384.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + e * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        tl.store(out_ptrs, tl.zeros((BLOCK_N,), out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _zero_tail(out_ptr, first, end, N, stride_om, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """Zeros in out[first:end (at most BLOCK_M rows), this program's n-tile]."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = first + tl.arange(0, BLOCK_M)
    mask = (offs_n < N)[:, None] & ((offs_m < end) & (offs_m >= 0))[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, tl.zeros((BLOCK_N, BLOCK_M), out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_tile(acc, bias_ptr, out_ptr, e, offs_n, offs_m, n_ok, m_ok, stride_be, stride_om,
                HAS_BIAS: tl.constexpr):  # fmt: skip
    """out[token rows, n-tile] = acc.T (+ expert e's bias) in out's dtype."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + e * stride_be + offs_n, mask=n_ok, other=0.0)
        acc += bias.to(tl.float32)[:, None]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


# ---- launchers ---------------------------------------------------------------------------------


def token_block(tokens: int, experts: int) -> int:
    """Tokens per block: the mean per expert rounded up to a power of two, in 16..128."""
    mean = -(-tokens // max(experts, 1))
    return min(128, max(16, triton.next_power_of_2(mean)))


def fp8_grouped_config(block_m: int) -> dict:
    """The best of the H100 sweep (bench/bench_moe.py --sweep, docs/kernels/grouped.md) on the
    Qwen3-30B-A3B and DeepSeek-V3 gate_up: activations quantized beforehand at every size
    (the act-quant kernel costs less than each tile redoing it: 15 vs 20 us at 1 token), 64
    weight rows x 16 tokens for decode, 128 x 64 for prefill (546 us at 4096 tokens, vs 696
    for 128 x 128 with 8 warps)."""
    if block_m <= 32:
        return {"BLOCK_N": 64, "BLOCK_M": block_m, "PREQUANT": True, "num_warps": 4,
                "num_stages": 3}  # fmt: skip
    return {"BLOCK_N": 128, "BLOCK_M": 64, "PREQUANT": True, "num_warps": 4, "num_stages": 4}


def _grid(n: int, tokens: int, experts: int, block_n: int, block_m: int) -> tuple[int, int]:
    """(n-tiles, token blocks): the experts' blocks and the tail's (rows after offs[-1]),
    together at most T (each block holds a row) and cdiv(T, BLOCK_M) + E + 1 (each hit expert
    and the tail waste at most one partial block)."""
    return triton.cdiv(n, block_n), min(tokens, triton.cdiv(tokens, block_m) + experts + 1)


def _bias_args(bias: torch.Tensor | None, out: torch.Tensor) -> tuple[torch.Tensor, int]:
    return (bias, bias.stride(0)) if bias is not None else (out, 0)


def fp8_grouped_launch(
    x: torch.Tensor, offs: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
    bias: torch.Tensor | None, block_n: int, block_k: int, group: int, ue8m0: bool,
    config: dict | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [T, K] sorted by expert, offs int32 [E], FP8 blockwise experts (qdata [E, N, K], scale
    [E, ceil(N/bn), ceil(K/bk)]), bias [E, N] or None -> [T, N] in x's dtype."""
    tokens, k = x.shape
    experts, n, _ = qdata.shape
    out = torch.empty((tokens, n), dtype=x.dtype, device=x.device)  # every row is written
    if tokens == 0 or n == 0 or experts == 0:
        return out.zero_()
    config = config or fp8_grouped_config(token_block(tokens, experts))
    config = dict(config)
    if INTERPRETED:
        config.update(num_stages=1)
    x_scale = x
    if config["PREQUANT"]:
        x, x_scale = act_quant_launch(x, group, ue8m0)
    bias_arg, stride_be = _bias_args(bias, out)
    grid = _grid(n, tokens, experts, config["BLOCK_N"], config["BLOCK_M"])
    _fp8_grouped_kernel[grid](
        x, x_scale, qdata, scale, bias_arg, out, offs,
        experts, tokens, n, k, x.stride(0), qdata.stride(0), qdata.stride(1), scale.stride(0),
        scale.stride(1), stride_be, out.stride(0),
        W_BLOCK_N=block_n, W_BLOCK_K=block_k, GROUP=group, UE8M0=ue8m0, EXACT_CAST=INTERPRETED,
        HAS_BIAS=bias is not None, EVEN_K=k % group == 0,
        E_POW2=triton.next_power_of_2(experts), **config,
    )  # fmt: skip
    return out


def w4a16_grouped_config(fmt: Format, tokens: int, experts: int, k: int) -> dict:
    """The grouped 4-bit kernel and its config for `tokens` routed rows over `experts`:
    - the word GEMV (KERNEL "gemv") while the mean rows per expert T / E is at most
      GEMV_MAX_ROWS_PER_EXPERT (decode: 1-16 tokens of every shape in bench_moe.py) and K is a
      multiple of 8 (whole 32-bit words per row): a program per (routed row, weight band), the
      rows of an expert side by side so that its band is read from HBM once. 16 weight rows x
      64 words (512 K) per step on 2 warps where K / 8 is a multiple of 64, else 16 x 32 words
      on 1 warp (Qwen3's down, K = 768; gpt-oss, K = 2880, with a masked last step): the best
      of the H100 sweeps on the Qwen3-30B-A3B and gpt-oss-120b experts (docs/kernels/grouped.md,
      "Why these configs (H100 sweeps)");
    - else the tensor-core kernel, 64 weight rows x `token_block` tokens x 128 K per step."""
    if k % 8 == 0 and tokens <= GEMV_MAX_ROWS_PER_EXPERT * experts:
        wide = (k // 8) % 64 == 0
        return {"KERNEL": "gemv", "BLOCK_N": 16, "BLOCK_W": 64 if wide else 32,
                "num_warps": 2 if wide else 1}  # fmt: skip
    return {"BLOCK_N": 64, "BLOCK_M": token_block(tokens, experts), "BLOCK_K": 128,
            "num_warps": 4, "num_stages": 3}  # fmt: skip


def w4a16_grouped_launch(
    fmt: Format, x: torch.Tensor, offs: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
    zero: torch.Tensor, global_scale: torch.Tensor, bias: torch.Tensor | None, group: int,
    k: int, config: dict | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [T, k] sorted by expert, offs int32 [E], 4-bit experts (qdata [E, N, ceil(k/2)], scale
    and zero [E, N, groups], global_scale [E, 1, 1]: each read only by the formats that have
    it), bias [E, N] or None -> [T, N] in x's dtype. `config`: `w4a16_grouped_config`'s by
    default."""
    tokens = x.shape[0]
    experts, n, kh = qdata.shape
    out = torch.empty((tokens, n), dtype=x.dtype, device=x.device)  # every row is written
    if tokens == 0 or n == 0 or experts == 0:
        return out.zero_()
    config = dict(config or w4a16_grouped_config(fmt, tokens, experts, k))
    has_zero = zero.numel() > 0
    zero_arg, stride_ze = (zero, zero.stride(0)) if has_zero else (qdata, 0)
    bias_arg, stride_be = _bias_args(bias.to(x.dtype) if bias is not None else None, out)
    common = dict(FORMAT=int(fmt), GROUP=group, HAS_BIAS=bias is not None,
                  E_POW2=triton.next_power_of_2(experts))  # fmt: skip
    if config.pop("KERNEL", None) == "gemv":
        assert k % 8 == 0, "the grouped GEMV reads whole 32-bit words of codes: K % 8 == 0"
        words = qdata.view(torch.int32)  # 8 codes per word, element 8w + j at bits 4j
        grid = (tokens, triton.cdiv(n, config["BLOCK_N"]))
        _w4a16_grouped_gemv_kernel[grid](
            x, words, _scale_arg(scale), zero_arg, global_scale, bias_arg, out, offs,
            experts, n, words.shape[2], x.stride(0), words.stride(0), words.stride(1),
            scale.stride(0), scale.stride(1), stride_ze, stride_be, out.stride(0),
            **common, **config,
        )  # fmt: skip
        return out
    grid = _grid(n, tokens, experts, config["BLOCK_N"], config["BLOCK_M"])
    if INTERPRETED:
        config.update(num_stages=1)
    _w4a16_grouped_kernel[grid](
        x, qdata, _scale_arg(scale), zero_arg, global_scale, bias_arg, out, offs,
        experts, tokens, n, k, kh, x.stride(0), qdata.stride(0), qdata.stride(1),
        scale.stride(0), scale.stride(1), stride_ze, stride_be, out.stride(0),
        EVEN_K=k % config["BLOCK_K"] == 0, X_FP32=x.dtype == torch.float32, **common, **config,
    )  # fmt: skip
    return out


# ---- torch.library ops -------------------------------------------------------------------------


def _contiguous(*tensors):
    return [t.contiguous() if t is not None else None for t in tensors]


@torch.library.custom_op("qshard::fp8_blockwise_grouped_linear", mutates_args=())
def fp8_blockwise_grouped_linear(
    x: torch.Tensor, offs: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
    bias: torch.Tensor | None, block_n: int, block_k: int, group: int, ue8m0: bool,
) -> torch.Tensor:  # fmt: skip
    """The grouped FP8 blockwise W8A8 matmul (module docstring)."""
    x, offs, qdata, scale, bias = _contiguous(x, offs, qdata, scale, bias)
    return fp8_grouped_launch(x, offs, qdata, scale, bias, block_n, block_k, group, ue8m0)


@fp8_blockwise_grouped_linear.register_fake
def _(x, offs, qdata, scale, bias, block_n, block_k, group, ue8m0):
    return x.new_empty((x.shape[0], qdata.shape[1]))


@torch.library.custom_op("qshard::w4a16_grouped_linear", mutates_args=())
def w4a16_grouped_linear(
    x: torch.Tensor, offs: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
    zero: torch.Tensor, global_scale: torch.Tensor, bias: torch.Tensor | None, fmt: str,
    group: int, k: int,
) -> torch.Tensor:  # fmt: skip
    """The grouped 4-bit weight-only matmul (module docstring); fmt a `Format` name
    ("int4_asym", "int4_sym", "int4_fzero", "mxfp4", "nvfp4"); an empty `zero` or
    `global_scale` where the format has none."""
    x, offs, qdata, scale, zero, global_scale, bias = _contiguous(
        x, offs, qdata, scale, zero, global_scale, bias
    )
    global_scale = global_scale if global_scale.numel() else qdata
    return w4a16_grouped_launch(Format[fmt.upper()], x, offs, qdata, scale, zero, global_scale,
                                bias, group, k)  # fmt: skip


@w4a16_grouped_linear.register_fake
def _(x, offs, qdata, scale, zero, global_scale, bias, fmt, group, k):
    return x.new_empty((x.shape[0], qdata.shape[1]))
