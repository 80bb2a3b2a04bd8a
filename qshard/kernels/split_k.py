"""Split-K for the swapped ("weight rows x tokens") small-M Triton kernels, shared by the FP8 and
int4 kernels: how many programs share a tile's K range, the zeroed workspace, and the epilogue
in which the last program of a tile to arrive writes it.

A tile is out.T[n-tile, m-tile] ([BLOCK_N weight rows, BLOCK_M tokens]); programs are laid out
(n-tile, split, m-tile). Each program stores its fp32 partial sums in its own slice of a
workspace [splits, M, N], then counts itself in the tile's counter (an acq_rel atomic after a
CTA barrier, so that its stores are visible first: the pattern of CUTLASS's serial split-K
semaphore); the last to arrive sums the slices in split order, adds the bias, casts and writes
the tile. One kernel and a memset of the counters per call, no reduction pass, and the same
result on every run (a first version added the partial sums with fp32 atomics, in arrival
order). The split count depends on the number of tiles, so a column-parallel shard can sum in
other groupings than the whole weight: equal up to fp32 summation order, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gpu import traits

__all__ = ["finish_tile", "programs_of", "sm_count", "split_count", "store_tile", "workspace"]


def sm_count(device_index: int) -> int:
    """The SMs of CUDA device `device_index` (`gpu.traits`, cached: a device query per launch
    costs host time)."""
    return traits(device_index).sms


def programs_of(device: torch.device) -> int:
    """The SMs that size a launch on `device`; on the CPU (the interpreter) 4, as if a GPU of
    4 SMs, so that tests exercise the splits."""
    return 4 if device.type == "cpu" else sm_count(device.index or 0)


def split_count(tiles: int, steps: int, min_steps: int, waves: float, device: torch.device) -> int:
    """Programs per tile so that about `waves` programs per SM run, each with >= min_steps K
    steps. On the CPU (the interpreter) as if 4 SMs, so that tests exercise the split."""
    sms = programs_of(device)
    return max(1, min(steps // min_steps, round(waves * sms / tiles)))


def workspace(m: int, n: int, splits: int, tiles: int, device: torch.device):
    """(fp32 partial sums [splits, M, N], each slice written whole; zeroed int32 counters)."""
    partials = torch.empty((splits, m, n), dtype=torch.float32, device=device)
    return partials, torch.zeros(tiles, dtype=torch.int32, device=device)


@triton.jit
def store_tile(
    acc, bias_ptr, out_ptr, offs_n, offs_m, n_ok, m_ok, stride_om, HAS_BIAS: tl.constexpr
):
    """out[m, n] = acc.T[m, n] + bias[n], the bias added in fp32, then cast to out's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def finish_tile(
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
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Write this program's [BLOCK_N, BLOCK_M] tile, or with SPLIT store it as its split's
    partial sums and, if it is the tile's last program to arrive, write their sum in split
    order. Grid: (n-tile, split, m-tile)."""
    if SPLIT:
        mask = n_ok[:, None] & m_ok[None, :]
        tile_ptrs = partials_ptr + offs_m[None, :] * N + offs_n[:, None]
        tl.store(tile_ptrs + tl.program_id(1) * M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial sums are stored before the program counts
        tile = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
        arrived = tl.atomic_add(arrived_ptr + tile, 1, sem="acq_rel")
        if arrived == tl.num_programs(1) - 1:  # the last split of this tile finishes it
            total = tl.zeros_like(acc)
            for split in range(0, tl.num_programs(1)):
                part_ptrs = tile_ptrs + split * M * N
                total += tl.load(part_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            store_tile(total, bias_ptr, out_ptr, offs_n, offs_m, n_ok, m_ok, stride_om, HAS_BIAS)
    else:
        store_tile(acc, bias_ptr, out_ptr, offs_n, offs_m, n_ok, m_ok, stride_om, HAS_BIAS)
