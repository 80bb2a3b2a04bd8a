"""Gluon (`triton.experimental.gluon`) as qshard's Hopper kernels use it, imported in one place:
the names Triton renamed after 3.6 (3.9 has only the new ones) are looked up here, and where
Gluon does not import, GLUON_IMPORT_ERROR says why (the names are then None and the kernel
modules define no kernel: their ops run the Triton kernels instead). And what the Hopper
kernels share: the chunk and tile sizes, the shared-memory budget, the "swap AB" epilogue store
(`store_transposed`) and the split-K epilogue of a 128-row tile's 64-row halves (`finish_half`,
with its workspace `half_tile_workspace`; `split_k.py`'s scheme)."""

from __future__ import annotations

import torch

__all__ = [
    "CHUNK",
    "GLUON_IMPORT_ERROR",
    "HALF_ROWS",
    "TILE_ROWS",
    "TensorDescriptor",
    "async_copy",
    "barrier",
    "cp_async",
    "fence_async_shared",
    "finish_half",
    "gl",
    "gluon",
    "gluon_unavailable",
    "half_tile_workspace",
    "mbarrier",
    "mma_v2",
    "reinterpret",
    "store_transposed",
    "tma",
    "tma_load",
    "warpgroup_mma",
    "warpgroup_mma_wait",
]

CHUNK = 128  # columns of K per chunk: an FP8 activation group, a ring slot of the 4-bit kernels
TILE_ROWS = 128  # the wgmma kernels' tile: one FP8 weight block of rows
HALF_ROWS = 64  # each consumer warpgroup's rows (wgmma's M per warpgroup)

try:  # in every Triton that torch ships since 3.4; its Hopper API as of triton 3.6
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        mma_v2,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    GLUON_IMPORT_ERROR = None
except Exception as error:  # an old or a future Triton
    GLUON_IMPORT_ERROR = f"{type(error).__name__}: {error}"
    gluon = gl = async_copy = fence_async_shared = mbarrier = mma_v2 = tma = None
    warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = None
    barrier = cp_async = tma_load = store_transposed = reinterpret = finish_half = None

if GLUON_IMPORT_ERROR is None:
    # a shared-memory view with another shape or layout: `reinterpret` since triton 3.7,
    # `_reinterpret` in 3.6
    _REINTERPRET = (
        getattr(gl.shared_memory_descriptor, "reinterpret", None)
        or gl.shared_memory_descriptor._reinterpret
    )

    @gluon.jit
    def reinterpret(desc, shape: gl.constexpr):
        """`desc`'s bytes viewed with another shape (same dtype and layout)."""
        return _REINTERPRET(desc, desc.dtype, shape, desc.layout)

    @gluon.jit
    def store_transposed(acc, bias_ptr, out_ptr, rows, toks, M, N, HAS_BIAS: gl.constexpr):
        """out[tok, row] = acc[row, tok] + bias[row] (fp32), cast to out's dtype: the epilogue
        of the "swap AB" kernels (weight rows on the MMA's M side, tokens on its N side)."""
        if HAS_BIAS:
            acc += gl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)[:, None]
        mask = (rows < N)[:, None] & (toks < M)[None, :]
        gl.store(
            out_ptr + toks[None, :] * N + rows[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask
        )

    _HALF_ROWS = gl.constexpr(HALF_ROWS)
    _TILE_ROWS = gl.constexpr(TILE_ROWS)

    @gluon.jit
    def finish_half(
        acc,
        bias_ptr,
        out_ptr,
        part_ptr,
        cnt_ptr,
        tile,
        split,
        splits,
        half,
        tiles,
        M,
        N,
        toks,
        HAS_BIAS: gl.constexpr,
        SPLIT: gl.constexpr,
    ):
        """Write this warpgroup's half tile, or store it as its split's partial sums and, if it
        is the half's last to arrive, write their sum in split order (split_k.py's scheme)."""
        MMA: gl.constexpr = acc.type.layout
        BLOCK_T: gl.constexpr = acc.type.shape[1]
        r = gl.arange(0, _HALF_ROWS, layout=gl.SliceLayout(1, MMA))
        rows = tile * _TILE_ROWS + half * _HALF_ROWS + r
        if SPLIT:
            # partial sums in fragment order, [8-token column block][row][8 tokens]: a warp's
            # rows g (lane / 4) and columns 2t, 2t + 1 (lane % 4) are 256 contiguous bytes, so
            # stores and loads are whole lines (at out's [token, row] offsets they are not)
            at = (toks // 8 * (8 * _HALF_ROWS))[None, :] + (r * 8)[:, None] + (toks % 8)[None, :]
            half_tile = (2 * tile + half) * (_HALF_ROWS * BLOCK_T)
            stride = 2 * tiles * _HALF_ROWS * BLOCK_T  # one split's partial sums
            gl.store(part_ptr + split * stride + half_tile + at, acc)
            barrier()  # the warpgroup's partial sums are stored before it counts itself
            arrived = gl.atomic_add(cnt_ptr + 2 * tile + half, 1, sem="acq_rel")
            if arrived == splits - 1:
                total = gl.zeros_like(acc)
                for sp in range(splits):
                    total += gl.load(part_ptr + sp * stride + half_tile + at, cache_modifier=".cg")
                store_transposed(total, bias_ptr, out_ptr, rows, toks, M, N, HAS_BIAS)
        else:
            store_transposed(acc, bias_ptr, out_ptr, rows, toks, M, N, HAS_BIAS)


def half_tile_workspace(splits: int, tiles: int, block_t: int, out: torch.Tensor) -> tuple:
    """`finish_half`'s split-K buffers: the fp32 partial sums of every split in fragment order,
    and a counter per half tile; `out` twice when K is not split (nothing is read then)."""
    if splits == 1:
        return out, out
    partials = torch.empty(
        splits * tiles * TILE_ROWS * block_t, dtype=torch.float32, device=out.device
    )
    # zeroed per launch (a memset): counters kept per device and stream and re-zeroed by the
    # last arrivals break when the cached tensor is first allocated under torch.compile's CUDA
    # graphs (warm-up and capture allocate from the graph's pool): "Detected 1 tensor(s) in the
    # cudagraph pool not tracked as outputs" (Llama fp8-block decode at batch 32;
    # docs/kernels/fp8_blockwise.md, "Gluon kernel: 2-64 tokens on Hopper")
    return partials, torch.zeros(2 * tiles, dtype=torch.int32, device=out.device)


def gluon_unavailable() -> str | None:
    """Why no Gluon kernel can run with this Triton, or None."""
    if GLUON_IMPORT_ERROR is None:
        return None
    import triton  # optional: only when Gluon is missing

    return f"Gluon is not available in triton {triton.__version__} ({GLUON_IMPORT_ERROR})"
