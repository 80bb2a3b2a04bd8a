"""What the grouped (mixture-of-experts) kernels share: which expert and rows a token block
stands for, the tail's zeros, the tile store, the grid and the token block size.

The tokens x [T, K] are sorted by expert; offs [E] int32 holds the end row of each expert's tokens
(transformers' grouped_mm convention, docs/design.md, "Experts in transformers"). out[rows of e] =
x[rows of e] @ W[e].T (+ bias[e]) for [E, N, K] experts; rows past offs[-1] are zeros. Their
definition is the per-expert 2-D reference (qshard/qtensor/grouped.py); tests compare against it.

Work split: the rows of each expert are cut into blocks of BLOCK_M tokens; a program takes one
(BLOCK_N weight rows, token block) tile, "swap AB" as the 2-D small-M kernels: the weight rows
are the MMA's M side (64+ rows fill a wgmma) and the few tokens of an expert its N side. Which
expert and rows a token-block index stands for is found in the kernel (`expert_block`: a
cumulative sum of the experts' block counts from offs), so the launch needs no host sync and
no index tensors: its grid is the upper bound cdiv(T, BLOCK_M) + E token blocks (each expert
wastes at most one partial block) and the programs past the last block return at once. Every
row index is also masked against T, so offsets that do not hold (decreasing, past T) never
reach memory outside x and out (the reference path refuses them with a typed error).

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

__all__ = [
    "INTERPRETED",
    "bias_args",
    "contiguous",
    "expert_block",
    "grid",
    "store_tile",
    "token_block",
    "zero_tail",
]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def expert_block(offs_ptr, E, T, pid_m, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
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
def zero_tail(out_ptr, first, end, N, stride_om, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """Zeros in out[first:end (at most BLOCK_M rows), this program's n-tile]."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = first + tl.arange(0, BLOCK_M)
    mask = (offs_n < N)[:, None] & ((offs_m < end) & (offs_m >= 0))[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, tl.zeros((BLOCK_N, BLOCK_M), out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_tile(
    acc,
    bias_ptr,
    out_ptr,
    e,
    offs_n,
    offs_m,
    n_ok,
    m_ok,
    stride_be,
    stride_om,
    HAS_BIAS: tl.constexpr,
):
    """out[token rows, n-tile] = acc.T (+ expert e's bias) in out's dtype."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + e * stride_be + offs_n, mask=n_ok, other=0.0)
        acc += bias.to(tl.float32)[:, None]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def token_block(tokens: int, experts: int) -> int:
    """Tokens per block: the mean per expert rounded up to a power of two, in 16..128."""
    mean = -(-tokens // max(experts, 1))
    return min(128, max(16, triton.next_power_of_2(mean)))


def grid(n: int, tokens: int, experts: int, block_n: int, block_m: int) -> tuple[int, int]:
    """(n-tiles, token blocks): the experts' blocks and the tail's (rows after offs[-1]),
    together at most T (each block holds a row) and cdiv(T, BLOCK_M) + E + 1 (each hit expert
    and the tail waste at most one partial block)."""
    return triton.cdiv(n, block_n), min(tokens, triton.cdiv(tokens, block_m) + experts + 1)


def bias_args(bias: torch.Tensor | None, out: torch.Tensor) -> tuple[torch.Tensor, int]:
    return (bias, bias.stride(0)) if bias is not None else (out, 0)


def contiguous(*tensors):
    """Each tensor contiguous (None stays None): the ops' kernels read rows at stride 1."""
    return [t.contiguous() if t is not None else None for t in tensors]
