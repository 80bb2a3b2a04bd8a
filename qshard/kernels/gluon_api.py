"""Gluon (`triton.experimental.gluon`) as qshard's Hopper kernels use it, imported in one place:
the names Triton renamed after 3.6 (3.9 has only the new ones) are looked up here, and where
Gluon does not import, GLUON_IMPORT_ERROR says why (the names are then None and the kernel
modules define no kernel: their ops run the Triton kernels instead); and `store_transposed`,
the epilogue store both Hopper kernels share."""

from __future__ import annotations

__all__ = [
    "GLUON_IMPORT_ERROR",
    "TensorDescriptor",
    "async_copy",
    "barrier",
    "cp_async",
    "fence_async_shared",
    "gl",
    "gluon",
    "gluon_unavailable",
    "mbarrier",
    "mma_v2",
    "reinterpret",
    "store_transposed",
    "tma",
    "tma_load",
    "warpgroup_mma",
    "warpgroup_mma_wait",
]

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
    barrier = cp_async = tma_load = store_transposed = reinterpret = None

if GLUON_IMPORT_ERROR is None:
    # a shared-memory view with another shape or layout: `reinterpret` since triton 3.7,
    # `_reinterpret` in 3.6
    _REINTERPRET = (getattr(gl.shared_memory_descriptor, "reinterpret", None)
                    or gl.shared_memory_descriptor._reinterpret)  # fmt: skip

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
        gl.store(out_ptr + toks[None, :] * N + rows[:, None],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)  # fmt: skip


def gluon_unavailable() -> str | None:
    """Why no Gluon kernel can run with this Triton, or None."""
    if GLUON_IMPORT_ERROR is None:
        return None
    import triton  # optional: only when Gluon is missing

    return f"Gluon is not available in triton {triton.__version__} ({GLUON_IMPORT_ERROR})"
