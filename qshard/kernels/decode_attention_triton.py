"""Split-K decode attention in Triton: one query token per sequence against a static KV cache,
the filled positions cut into splits that run as programs of their own (flash-decoding), then
one combine kernel. The definition, the op and the CPU path: `decode_attention.py`.

Why split: at batch 1 a Llama-3.1-8B layer has 8 KV heads, so a program per (sequence, KV head)
fills 8 of an H200's 132 SMs; cut into splits, more SMs stream a piece of the cache each. Each
program takes all query heads of its KV group at once (GQA: each K and V row is read once), as
a [BLOCK_G, D] tile padded to the MMA's 16 rows. The grid's split count is fixed by the cache's
shape (CUDA graphs replay one grid); each program divides the positions filled so far
(input_pos + 1, read on the device) among the splits, whole blocks each, so the positions after
input_pos are never read and a split with none left exits at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .split_k import programs_of

__all__ = ["decode_attention_launch", "split_plan"]

LOG2E = 1.4426950408889634
MAX_SPLITS = 64  # the combine loads a [splits, D] fp32 tile at once: 64 x 128 is 64 registers


@triton.jit
def _decode_attention_split(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    out_ptr,
    part_o_ptr,
    part_ml_ptr,
    HKV,
    S,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_ob,
    stride_oh,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Program (b * HKV + kv head, split): the online softmax of the G query heads over the
    split's positions <= input_pos. SPLIT: store the unnormalised sums and (max, sum of
    exponentials) per head for the combine kernel; else write the output."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)  # a sequence's cache offset passes 2**31 in large caches
    kvh = bh % HKV
    length = tl.minimum(tl.load(pos_ptr).to(tl.int32) + 1, S)
    split_len = tl.cdiv(tl.cdiv(length, tl.num_programs(1)), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, length)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    g_ok = offs_g < G
    heads = kvh * G + offs_g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_ok[:, None],
        other=0.0,
    )
    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh

    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, D), tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        k = tl.load(
            k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=n_ok[:, None], other=0.0
        )
        s = tl.dot(q, tl.trans(k)) * qk_scale  # log2 units: exp2 below
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=n_ok[:, None], other=0.0
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if SPLIT:  # the real heads' partials: [B * Hq, splits, D] and [B * Hq, splits, 2]
        at = (b * HKV * G + heads) * tl.num_programs(1) + split
        tl.store(part_o_ptr + at[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None])
        tl.store(part_ml_ptr + at * 2, m_i, mask=g_ok)
        tl.store(part_ml_ptr + at * 2 + 1, l_i, mask=g_ok)
    else:
        out = acc / l_i[:, None]
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


@triton.jit
def _decode_attention_combine(
    part_o_ptr,
    part_ml_ptr,
    out_ptr,
    HQ,
    splits,
    stride_ob,
    stride_oh,
    D: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """Program b * Hq + query head: its splits' sums rescaled to their common maximum and
    added (one load of all of them: a loop over the splits waits on each in turn), divided by
    the summed exponentials. The same result on every run."""
    bh = tl.program_id(0)
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, D)
    s_ok = offs_s < splits
    at = bh * splits + offs_s
    m_s = tl.load(part_ml_ptr + at * 2, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + at * 2 + 1, mask=s_ok, other=0.0)
    o_s = tl.load(part_o_ptr + at[:, None] * D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    m = tl.max(m_s, 0)
    w = tl.where(m_s == float("-inf"), 0.0, tl.exp2(m_s - m))  # an empty split weighs 0
    out = tl.sum(w[:, None] * o_s, 0) / tl.sum(w * l_s, 0)
    o_ptrs = out_ptr + (bh // HQ).to(tl.int64) * stride_ob + (bh % HQ) * stride_oh + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty))


def split_plan(
    batch_heads: int,
    positions: int,
    head_dim: int,
    device: torch.device,
    splits: int | None = None,
    block_n: int | None = None,
) -> tuple[int, int]:
    """(splits, positions a block) for a cache of `positions` per (sequence, KV head) pair.
    Blocks of 128 positions (64 for head dims above 128: two stages of K and V tiles must fit
    in shared memory); splits: about 2 programs per SM over the pairs, at most one per block of
    the cache and MAX_SPLITS; 1 (no combine kernel) where the pairs fill the GPU. Within 1 %
    of the best of an H200 sweep (`bench_decode_attention.py --sweep`, Llama-3.1-8B's 8 KV
    heads, 1288 positions): batch 1, 11 splits of 128 (6.8 us a layer); batch 32, 1 split
    (38.8 us; 2 splits 40.2). `splits` and `block_n` override the plan (tests, sweeps)."""
    block_n = block_n or (128 if head_dim <= 128 else 64)
    if splits is None:
        blocks = triton.cdiv(positions, block_n)
        wanted = round(2 * programs_of(device) / batch_heads)
        splits = max(1, min(blocks, MAX_SPLITS, wanted))
    return splits, block_n


def decode_attention_launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    input_pos: torch.Tensor,
    scale: float,
    splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, 1, D], caches [B, Hkv, S, D] (unit stride along D), input_pos [1] on q's
    device -> [B, Hq, 1, D] in q's dtype, contiguous. `splits` and `block_n` override
    `split_plan`'s (tests, bench sweeps; splits <= MAX_SPLITS)."""
    b, hq, _, d = q.shape
    hkv, positions = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    block_g = max(16, triton.next_power_of_2(group))
    splits, block_n = split_plan(b * hkv, positions, d, q.device, splits, block_n)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    split = splits > 1
    if split:
        part_o = torch.empty((b * hq, splits, d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((b * hq, splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = out  # not read
    _decode_attention_split[(b * hkv, splits)](
        q,
        k_cache,
        v_cache,
        input_pos,
        out,
        part_o,
        part_ml,
        hkv,
        positions,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        out.stride(0),
        out.stride(1),
        G=group,
        BLOCK_G=block_g,
        D=d,
        BLOCK_N=block_n,
        SPLIT=split,
        num_warps=4,
        num_stages=2,
    )
    if split:
        _decode_attention_combine[(b * hq,)](
            part_o,
            part_ml,
            out,
            hq,
            splits,
            out.stride(0),
            out.stride(1),
            D=d,
            SPLITS=triton.next_power_of_2(splits),
            num_warps=4,
        )
    return out
