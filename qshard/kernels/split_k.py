"""Split-K for the swapped ("weight rows x tokens") small-M Triton kernels, shared by the FP8 and
int4 kernels: how many programs share a tile's K range, the zeroed workspace, and the epilogue
in which the last program of a tile to arrive writes it.

A tile is out.T[n-tile, m-tile] ([BLOCK_N weight rows, BLOCK_M tokens]); programs are laid out
(n-tile, split, m-tile). Partial sums go into an fp32 workspace with atomic adds; each program
then counts itself in the tile's counter (an acq_rel atomic after a CTA barrier, so its adds are
visible first), and the last to arrive adds the bias, casts and writes the tile. One kernel and
one memset per call, no reduction pass. Summation order across splits is not fixed, so results
may differ in the last fp32 bits from run to run (as any split-K GEMM).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["finish_tile", "split_count", "store_tile", "workspace"]


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_count(tiles: int, steps: int, min_steps: int, waves: float, device: torch.device) -> int:
    """Programs per tile so that about `waves` programs per SM run, each with >= min_steps K
    steps. On the CPU (the interpreter) as if 4 SMs, so that tests exercise the split."""
    sms = 4 if device.type == "cpu" else _sm_count(device.index or 0)
    return max(1, min(steps // min_steps, round(waves * sms / tiles)))


def workspace(m: int, n: int, tiles: int, device: torch.device):
    """One zeroed buffer: fp32 partial sums [M, N], then an int32 counter per tile."""
    buffer = torch.zeros(m * n + tiles, dtype=torch.int32, device=device)
    return buffer[: m * n].view(torch.float32), buffer[m * n :]


@triton.jit
def store_tile(acc, bias_ptr, out_ptr, offs_n, offs_m, n_ok, m_ok, stride_om,
               HAS_BIAS: tl.constexpr):  # fmt: skip
    """out[m, n] = acc.T[m, n] + bias[n], the bias added in fp32, then cast to out's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def finish_tile(acc, acc_ptr, arrived_ptr, bias_ptr, out_ptr, offs_n, offs_m, n_ok, m_ok, N,
                stride_om, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    """Write this program's [BLOCK_N, BLOCK_M] tile, or with SPLIT add it to the workspace and,
    if it is the tile's last program to arrive, write the sum. Grid: (n-tile, split, m-tile)."""
    if SPLIT:
        mask = n_ok[:, None] & m_ok[None, :]
        acc_ptrs = acc_ptr + offs_m[None, :] * N + offs_n[:, None]
        tl.atomic_add(acc_ptrs, acc, mask=mask, sem="relaxed")
        tl.debug_barrier()  # every thread's partial sums are in before the program counts itself
        tile = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
        arrived = tl.atomic_add(arrived_ptr + tile, 1, sem="acq_rel")
        if arrived == tl.num_programs(1) - 1:  # the last split of this tile finishes it
            acc = tl.load(acc_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            store_tile(acc, bias_ptr, out_ptr, offs_n, offs_m, n_ok, m_ok, stride_om, HAS_BIAS)
    else:
        store_tile(acc, bias_ptr, out_ptr, offs_n, offs_m, n_ok, m_ok, stride_om, HAS_BIAS)
