"""Split-K decode attention in Triton: one query token per sequence against a static KV cache,
the cache's positions cut into splits that run as programs of their own (flash-decoding), then
one combine kernel. The definition, the op and the CPU path: `decode_attention.py`.

Why split: at batch 1 a Llama-3.1-8B layer has 8 KV heads, so a program per (sequence, KV head)
fills 8 of an H100's 132 SMs; cut into splits of 64-position blocks every SM streams a piece of
the cache. Each program takes all query heads of its KV group at once (GQA: each K and V row is
read once), as a [BLOCK_G, D] tile padded to the MMA's 16 rows. Positions after `input_pos` are
not read: their blocks are skipped, so a split past the last position exits at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .split_k import programs_of

__all__ = ["decode_attention_launch", "split_plan"]

BLOCK_N = 64  # cache positions a step
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

    if SPLIT:
        splits = tl.num_programs(1)
        at = (bh * splits + split) * BLOCK_G + offs_g
        tl.store(part_o_ptr + at[:, None] * D + offs_d[None, :], acc)
        tl.store(part_ml_ptr + at * 2, m_i)
        tl.store(part_ml_ptr + at * 2 + 1, l_i)
    else:
        out = acc / l_i[:, None]
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


@triton.jit
def _decode_attention_combine(
    part_o_ptr,
    part_ml_ptr,
    out_ptr,
    HKV,
    splits,
    stride_ob,
    stride_oh,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
):
    """Program b * HKV + kv head: the splits' sums rescaled to their common maximum and added
    in split order (the same result on every run), divided by the summed exponentials."""
    bh = tl.program_id(0)
    b = bh // HKV
    kvh = bh % HKV
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    for s in range(0, splits):
        m = tl.maximum(m, tl.load(part_ml_ptr + ((bh * splits + s) * BLOCK_G + offs_g) * 2))
    total = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, D), tl.float32)
    for s in range(0, splits):
        at = (bh * splits + s) * BLOCK_G + offs_g
        m_s = tl.load(part_ml_ptr + at * 2)
        w = tl.where(m_s == float("-inf"), 0.0, tl.exp2(m_s - m))  # an empty split weighs 0
        total += w * tl.load(part_ml_ptr + at * 2 + 1)
        acc += w[:, None] * tl.load(part_o_ptr + at[:, None] * D + offs_d[None, :])
    heads = kvh * G + offs_g
    o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    out = acc / total[:, None]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=(offs_g < G)[:, None])


def split_plan(batch_heads: int, positions: int, device: torch.device) -> tuple[int, int]:
    """(splits, positions per split): about 4 programs per SM over the (sequence, KV head)
    pairs, each split a whole number of BLOCK_N blocks. 1 split where the pairs fill the GPU."""
    blocks = triton.cdiv(positions, BLOCK_N)
    splits = max(1, min(blocks, round(4 * programs_of(device) / batch_heads)))
    per_split = triton.cdiv(blocks, splits) * BLOCK_N
    return triton.cdiv(positions, per_split), per_split


def decode_attention_launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    input_pos: torch.Tensor,
    scale: float,
    splits: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, 1, D], caches [B, Hkv, S, D] (unit stride along D) -> [B, Hq, 1, D] in q's
    dtype. `splits` overrides `split_plan`'s count (tests)."""
    b, hq, _, d = q.shape
    hkv, positions = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    block_g = max(16, triton.next_power_of_2(group))
    if splits is None:
        splits, per_split = split_plan(b * hkv, positions, q.device)
    else:
        per_split = triton.cdiv(triton.cdiv(positions, splits), BLOCK_N) * BLOCK_N
        splits = triton.cdiv(positions, per_split)
    out = torch.empty_like(q)
    split = splits > 1
    if split:
        part_o = torch.empty((b * hkv, splits, block_g, d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((b * hkv, splits, block_g, 2), dtype=torch.float32, device=q.device)
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
        BLOCK_N=BLOCK_N,
        SPLIT=split,
        num_warps=4,
        num_stages=2,
    )
    if split:
        _decode_attention_combine[(b * hkv,)](
            part_o,
            part_ml,
            out,
            hkv,
            splits,
            out.stride(0),
            out.stride(1),
            G=group,
            BLOCK_G=block_g,
            D=d,
            num_warps=4,
        )
    return out
