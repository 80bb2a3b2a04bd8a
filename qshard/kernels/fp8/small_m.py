"""The FP8 blockwise small-M kernel (2..64 tokens): "swap AB" (weight rows on the MMA's M side,
the tokens on its N side), K groups split over programs (`split_k.py`), the activations
quantized in registers or beforehand by the act-quant kernel (PREQUANT, per SMALL_M_TABLE).

GEMM: y[m, n] = sum over activation groups g of
    (sum_{k in g} xq[m, k] * wq[n, k]) * (x_scale[m, g] * w_scale[n // bn, k // bk])
The fp8 dot of one group is accumulated by the tensor cores (or CUDA cores), then promoted to
fp32 with its scales (DeepSeek-V3 §3.3.2), so the K step is the activation group (128, or 64
after re-blocking). Runs on the GPU (sm_89+: Triton's fp8 dot), and on the CPU under
TRITON_INTERPRET=1 for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..split_k import finish_tile, split_count, workspace
from .act_quant import INTERPRETED, act_quant_launch, quantize_rows

__all__ = ["SMALL_M_TABLE", "config", "launch", "problem"]

MIN_GROUPS_PER_SPLIT = 4


def problem(
    x: torch.Tensor, qdata: torch.Tensor, block_n: int, block_k: int, group: int
) -> str | None:
    """None: the small-M kernel runs every block and group size and any token count (its
    tile grows to 64 tokens; more take several tiles)."""
    return None


@triton.jit
def _small_m_kernel(
    x_ptr,
    x_scale_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    partials_ptr,
    arrived_ptr,
    M,
    N,
    K,
    groups_per_split,
    stride_xm,
    stride_wn,
    stride_wsn,
    stride_om,
    W_BLOCK_N: tl.constexpr,
    W_BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    UE8M0: tl.constexpr,
    EXACT_CAST: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SPLIT: tl.constexpr,
    PREQUANT: tl.constexpr,
):
    """Small M, "swap AB": the weight rows are the MMA's M side (64+ rows fill a wgmma) and the
    few tokens its N side, out.T[n-tile, m-tile] = W[n-tile] @ xq.T. The activation tile is
    quantized in registers per group (fused: no act-quant kernel, no scales round trip), or with
    PREQUANT read quantized (x_ptr e4m3, x_scale_ptr group-major scales). The K
    groups are split over programs so that N/BLOCK_N tiles still fill every SM (SPLIT: several
    programs per tile, summed as `split_k.py` describes)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first_group = tl.program_id(1) * groups_per_split
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok, m_ok = offs_n < N, offs_m < M
    offs_k = first_group * GROUP + tl.arange(0, GROUP)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    w_scale_ptrs = w_scale_ptr + (offs_n // W_BLOCK_N) * stride_wsn
    last_group = tl.minimum(first_group + groups_per_split, tl.cdiv(K, GROUP))
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for g in range(first_group, last_group):
        if EVEN_K:
            x_mask, w_mask = m_ok[:, None], n_ok[:, None]
        else:
            k_ok = offs_k < K - (g - first_group) * GROUP
            x_mask, w_mask = m_ok[:, None] & k_ok[None, :], n_ok[:, None] & k_ok[None, :]
        if PREQUANT:
            xq = tl.load(x_ptrs, mask=x_mask, other=0.0)
            x_scale = tl.load(x_scale_ptr + g * M + offs_m, mask=m_ok, other=0.0)
        else:  # padded rows quantize to 0 with scale 1
            x = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)
            xq, x_scale = quantize_rows(x, UE8M0, EXACT_CAST, False)
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        w_scale = tl.load(w_scale_ptrs + (g * GROUP) // W_BLOCK_K, mask=n_ok, other=0.0)
        partial = tl.dot(w, tl.trans(xq))
        acc += partial * (w_scale[:, None] * x_scale[None, :])
        x_ptrs += GROUP
        w_ptrs += GROUP
    finish_tile(
        acc,
        partials_ptr,
        arrived_ptr,
        bias_ptr,
        out_ptr,
        offs_n,
        offs_m,
        n_ok,
        m_ok,
        M,
        N,
        stride_om,
        HAS_BIAS,
        SPLIT,
    )


# The small-M kernel's tiles by M (H200 sweep, docs/kernels/fp8_blockwise.md): (largest M,
# weight rows per tile, programs per SM, pipeline stages, warps, quantize activations apart).
SMALL_M_TABLE = (
    (8, 64, 4, 4, 4, True),
    (16, 128, 2, 4, 8, False),
    (32, 64, 4, 4, 4, True),
    (64, 128, 2, 3, 8, True),
)


def config(
    m: int,
    n: int,
    k: int,
    group: int,
    device: torch.device,
    block_n: int | None = None,
    waves: float = 2,
    num_stages: int = 4,
    num_warps: int = 4,
    prequant: bool = False,
    max_block_m: int = 64,
) -> dict:
    """Tiles of `block_n` weight rows x the tokens (16..max_block_m), and the K groups split so
    that about `waves` programs per SM run, each streaming >= MIN_GROUPS_PER_SPLIT groups.
    Without `block_n`, the tuned row of SMALL_M_TABLE for M."""
    if block_n is None:
        row = next((r for r in SMALL_M_TABLE if m <= r[0]), SMALL_M_TABLE[-1])
        block_n, waves, num_stages, num_warps, prequant = row[1:]
    block_m = min(max_block_m, max(16, triton.next_power_of_2(m)))
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = split_count(tiles, triton.cdiv(k, group), MIN_GROUPS_PER_SPLIT, waves, device)
    return {
        "BLOCK_N": block_n,
        "BLOCK_M": block_m,
        "SPLIT_K": split,
        "PREQUANT": prequant,
        "num_warps": num_warps,
        "num_stages": num_stages,
    }


def launch(
    x, qdata, scale, bias, out, block_n: int, block_k: int, group: int, ue8m0: bool, config: dict
) -> torch.Tensor:
    """out [M, N] = x @ W.T + bias with `config` (`config()`'s keys)."""
    m, k = x.shape
    n = qdata.shape[0]
    config = dict(config)  # (SPLIT_K is taken out of it)
    groups = triton.cdiv(k, group)
    split = min(config.pop("SPLIT_K"), groups)
    groups_per_split = triton.cdiv(groups, split)
    split = triton.cdiv(groups, groups_per_split)  # no program without a group
    config.setdefault("PREQUANT", False)
    x, x_scale = act_quant_launch(x, group, ue8m0) if config["PREQUANT"] else (x, x)
    grid = (triton.cdiv(n, config["BLOCK_N"]), split, triton.cdiv(m, config["BLOCK_M"]))
    tiles = grid[0] * grid[2]
    partials, arrived = workspace(m, n, split, tiles, x.device) if split > 1 else (out, out)
    _small_m_kernel[grid](
        x,
        x_scale,
        qdata,
        scale,
        bias if bias is not None else out,
        out,
        partials,
        arrived,
        m,
        n,
        k,
        groups_per_split,
        x.stride(0),
        qdata.stride(0),
        scale.stride(0),
        out.stride(0),
        W_BLOCK_N=block_n,
        W_BLOCK_K=block_k,
        GROUP=group,
        HAS_BIAS=bias is not None,
        UE8M0=ue8m0,
        EXACT_CAST=INTERPRETED,
        EVEN_K=k % group == 0,
        SPLIT=split > 1,
        **config,
    )
    return out
