"""The small-M tensor-core kernel: 2..128 tokens, "swap AB" (weight rows on the MMA's M side,
the tokens on its N side), K split over programs so that a 4096-wide layer fills the GPU
(`split_k.py`). The weight tile is dequantized in fp32 and rounded to the activation dtype, as
the reference. The op runs it where no register kernel runs (`select.py`); on the H100, with
the tuned configs, the Llama-3.1-8B layer at 32 tokens takes int4 129 us, MXFP4 146 us, NVFP4
176 us (docs/kernels/w4a16.md, "The small-M tensor-core kernel"). `small_m_step` and
`small_m_mma` are the grouped expert kernel's steps too (`kernels/grouped/`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..split_k import finish_tile, split_count, workspace
from .decode import (
    INTERPRETED,
    launch_args,
    load_global_scale,
    step_codes,
    step_weights,
    step_words,
    word_weights,
)

__all__ = ["config", "launch", "problem", "small_m_mma", "small_m_step"]

MIN_STEPS_PER_SPLIT = 4


def problem(fmt: int, x: torch.Tensor, qdata: torch.Tensor, group: int) -> str | None:
    """None: the small-M kernel runs every format, group and K (masked where K is not a
    multiple of its step)."""
    return None


@triton.jit
def small_m_step(
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
    FORMAT: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """The small-M kernel's loads of one step (N: the rows to load, 0 for none): the codes as
    words when K is a multiple of the step (`step_words`, decoded by `word_weights`), else as
    bytes (`step_codes`)."""
    if EVEN_K:
        return step_words(
            q_ptr.to(tl.pointer_type(tl.int32)),
            s_ptr,
            z_ptr,
            offs_n,
            k0,
            N,
            K,
            stride_qn // 4,
            stride_sn,
            FORMAT,
            GROUP,
            BLOCK_K,
        )
    else:
        return step_codes(
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
            False,
        )


@triton.jit
def small_m_mma(
    acc,
    codes,
    scale,
    zero,
    x,
    global_scale,
    FORMAT: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    X_FP32: tl.constexpr,
):
    """acc + one step's weights (rounded to the activation dtype, as the reference) @ x."""
    if EVEN_K:
        w = word_weights(codes, scale, zero, global_scale, FORMAT, GROUP, BLOCK_K, x.dtype)
    else:
        w = step_weights(codes, scale, zero, global_scale, FORMAT, GROUP, BLOCK_K).to(x.dtype)
    if X_FP32:  # fp32 activations: a true fp32 product, not TF32
        return tl.dot(w, x, acc, input_precision="ieee")
    return tl.dot(w, x, acc)


@triton.jit
def _small_m_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    g_ptr,
    bias_ptr,
    out_ptr,
    partials_ptr,
    arrived_ptr,
    M,
    N,
    K,
    KH,
    steps_per_split,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_om,
    FORMAT: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    X_FP32: tl.constexpr,
    SPLIT: tl.constexpr,
    PREFETCH: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out.T[n-tile, m-tile] = W[n-tile] @ x[m-tile].T over this program's K steps.

    The codes and scales are loaded PREFETCH (1 or 2, a tuned choice) steps ahead of their
    decoding. The compiler places a load whose value the next iteration uses at the end of the
    loop body, next to the MMA (SASS for sm_90), so one step ahead leaves the loads only the MMA's
    time; two steps ahead costs registers and moves. Neither wins everywhere (measured:
    docs/kernels/w4a16.md, "The small-M tensor-core kernel"). With 1 the activations are loaded
    by hand a step ahead too; with 2 at the top of their step (hidden behind the decoding). A
    load past this program's last step loads nothing with 2, and the next split's first step
    (not used) with 1."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first_step = tl.program_id(1) * steps_per_split
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    last_step = tl.minimum(first_step + steps_per_split, tl.cdiv(K, BLOCK_K))
    global_scale = load_global_scale(g_ptr, FORMAT)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]  # x.T: [BLOCK_K, BLOCK_M]
    m_ok = (offs_m < M)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k0 = first_step * BLOCK_K
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
    if PREFETCH == 2:
        k_end = last_step * BLOCK_K  # (`N * (k < k_end)` rows: none past the last step)
        k1 = k0 + BLOCK_K
        codes1, scale1, zero1 = small_m_step(
            q_ptr,
            s_ptr,
            z_ptr,
            offs_n,
            k1,
            N * (k1 < k_end),
            K,
            KH,
            stride_qn,
            stride_sn,
            FORMAT,
            GROUP,
            BLOCK_K,
            EVEN_K,
        )
        for step in range(first_step, last_step):
            k2 = (step + 2) * BLOCK_K
            codes2, scale2, zero2 = small_m_step(
                q_ptr,
                s_ptr,
                z_ptr,
                offs_n,
                k2,
                N * (k2 < k_end),
                K,
                KH,
                stride_qn,
                stride_sn,
                FORMAT,
                GROUP,
                BLOCK_K,
                EVEN_K,
            )
            k0 = step * BLOCK_K
            x = tl.load(x_ptrs + k0, mask=m_ok & (k0 + offs_k < K)[:, None], other=0.0)
            acc = small_m_mma(
                acc, codes, scale, zero, x, global_scale, FORMAT, GROUP, BLOCK_K, EVEN_K, X_FP32
            )
            codes, scale, zero = codes1, scale1, zero1
            codes1, scale1, zero1 = codes2, scale2, zero2
    else:
        x = tl.load(x_ptrs + k0, mask=m_ok & (k0 + offs_k < K)[:, None], other=0.0)
        for step in range(first_step, last_step):
            k1 = (step + 1) * BLOCK_K
            next_codes, next_scale, next_zero = small_m_step(
                q_ptr,
                s_ptr,
                z_ptr,
                offs_n,
                k1,
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
            next_x = tl.load(x_ptrs + k1, mask=m_ok & (k1 + offs_k < K)[:, None], other=0.0)
            acc = small_m_mma(
                acc, codes, scale, zero, x, global_scale, FORMAT, GROUP, BLOCK_K, EVEN_K, X_FP32
            )
            codes, scale, zero, x = next_codes, next_scale, next_zero, next_x
    finish_tile(
        acc,
        partials_ptr,
        arrived_ptr,
        bias_ptr,
        out_ptr,
        offs_n,
        offs_m,
        offs_n < N,
        offs_m < M,
        M,
        N,
        stride_om,
        HAS_BIAS,
        SPLIT,
    )


def config(m: int, n: int, k: int, device: torch.device) -> dict:
    """64 weight rows x the tokens (16..128) x 128 K per step, K split so that ~4 programs run
    per SM up to 64 tokens (~2 above): the best of the H200 sweep at M = 16 and 128. The codes
    are loaded two steps ahead for 128-token tiles: with PREFETCH 2 this config took 11-19 %
    less time than with 1 on the H100 on each shape where both were timed (o and down at
    M = 128, every format; docs/kernels/w4a16.md, "The small-M tensor-core kernel"); at 16-64
    tokens neither depth wins everywhere."""
    block_n, block_m, block_k = 64, min(128, max(16, triton.next_power_of_2(m))), 128
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    waves = 4 if m <= 64 else 2
    split = split_count(tiles, triton.cdiv(k, block_k), MIN_STEPS_PER_SPLIT, waves, device)
    return {
        "BLOCK_N": block_n,
        "BLOCK_M": block_m,
        "BLOCK_K": block_k,
        "SPLIT_K": split,
        "PREFETCH": 2 if block_m == 128 else 1,
        "num_warps": 4,
        "num_stages": 3,
    }


def launch(
    fmt: int, x, qdata, scale, zero, bias, out, group: int, config: dict, global_scale
) -> torch.Tensor:
    """out [M, N] = x [M, K] @ W.T + bias with `config` (`config()`'s keys, or a tuned one)."""
    m, k = x.shape
    n = qdata.shape[0]
    # a tuned entry without PREFETCH loads one step ahead
    config = {"PREFETCH": 1, **{key: v for key, v in config.items() if key != "KERNEL"}}
    if config["PREFETCH"] not in (1, 2):
        raise ValueError(
            f"small-M config PREFETCH={config['PREFETCH']!r}: the codes are loaded "
            "1 or 2 steps ahead; give 1 or 2 (or leave it out for 1)"
        )
    if INTERPRETED:  # the interpreter runs one program at a time, sequentially
        config.update(num_stages=1)
    args, common = launch_args(fmt, x, qdata, scale, zero, global_scale, bias, out, group)
    steps = triton.cdiv(k, config["BLOCK_K"])
    steps_per_split = triton.cdiv(steps, min(config.pop("SPLIT_K"), max(steps, 1)))
    split = triton.cdiv(steps, steps_per_split) if steps else 1
    grid = (triton.cdiv(n, config["BLOCK_N"]), split, triton.cdiv(m, config["BLOCK_M"]))
    partials, arrived = (
        workspace(m, n, split, grid[0] * grid[2], x.device) if split > 1 else (out, out)
    )
    _small_m_kernel[grid](
        *args,
        partials,
        arrived,
        m,
        n,
        k,
        qdata.shape[1],
        steps_per_split,
        x.stride(0),
        qdata.stride(0),
        scale.stride(0),
        out.stride(0),
        X_FP32=x.dtype == torch.float32,
        SPLIT=split > 1,
        EVEN_K=k % config["BLOCK_K"] == 0,
        **common,
        **config,
    )
    return out
