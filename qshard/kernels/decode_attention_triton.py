"""Split-K decode attention in Triton: one query token per sequence against a static KV cache,
the cache's positions cut into splits that run as programs of their own (flash-decoding), then
one combine kernel. The definition, the op and the CPU path: `decode_attention.py`.

Why split: at batch 1 a Llama-3.1-8B layer has 8 KV heads, so a program per (sequence, KV head)
fills 8 of an H200's 132 SMs; cut into splits of 128-position blocks every SM streams a piece
of the cache. Each program takes all query heads of its KV group at once (GQA: each K and V row is
read once), as a [BLOCK_G, D] tile padded to the MMA's 16 rows. Positions after `input_pos` are
not read: their blocks are skipped, so a split past the last position exits at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .split_k import programs_of

__all__ = ["decode_attention_launch", "split_plan"]

BLOCK_N = 128  # cache positions a step
LOG2E = 1.4426950408889634


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
    split_len,
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
    b = bh // HKV
    kvh = bh % HKV
    length = tl.minimum(tl.load(pos_ptr).to(tl.int32) + 1, S)
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
    o_ptrs = out_ptr + (bh // HQ) * stride_ob + (bh % HQ) * stride_oh + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty))


def split_plan(
    batch_heads: int, positions: int, device: torch.device, block_n: int = BLOCK_N
) -> tuple[int, int]:
    """(splits, positions per split): about 2 programs per SM over the (sequence, KV head)
    pairs, each split a whole number of `block_n` blocks; 1 split (no combine kernel) where
    the pairs fill the GPU. The best of an H200 sweep (`bench_decode_attention.py --sweep`,
    Llama-3.1-8B's 8 KV heads, 1288 positions): at batch 1, 11 splits of 128 positions (6.8 us
    a layer; 21 of 64: 7.4), at batch 32 one split of 128 (38.8 us; 2 splits: 40.2)."""
    blocks = triton.cdiv(positions, block_n)
    splits = max(1, min(blocks, round(2 * programs_of(device) / batch_heads)))
    per_split = triton.cdiv(blocks, splits) * block_n
    return triton.cdiv(positions, per_split), per_split


def decode_attention_launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    input_pos: torch.Tensor,
    scale: float,
    splits: int | None = None,
    block_n: int = BLOCK_N,
) -> torch.Tensor:
    """q [B, Hq, 1, D], caches [B, Hkv, S, D] (unit stride along D) -> [B, Hq, 1, D] in q's
    dtype. `splits` and `block_n` override `split_plan`'s (tests, bench sweeps)."""
    b, hq, _, d = q.shape
    hkv, positions = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    block_g = max(16, triton.next_power_of_2(group))
    if splits is None:
        splits, per_split = split_plan(b * hkv, positions, q.device, block_n)
    else:
        per_split = triton.cdiv(triton.cdiv(positions, splits), block_n) * block_n
        splits = triton.cdiv(positions, per_split)
    out = torch.empty_like(q)
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
        per_split,
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
