"""Load the kernel modules that register qshard's GPU ops, once, when a kernel is about to run.

The kernel modules import Triton (seconds, and an optional dependency on the CPU), so they are
imported here, inside the loaders, and never at `import qshard`; `availability.py` says first
whether they can run at all."""

from __future__ import annotations

import functools

__all__ = ["load_gpu_ops", "load_grouped_ops", "load_w4a8_ops", "load_w4a16_ops"]


@functools.cache
def load_gpu_ops() -> None:
    """Import the kernel modules once: that registers `torch.ops.qshard.fp8_*`."""
    from .fp8 import ops  # noqa: F401  (imports Triton)


@functools.cache
def load_w4a16_ops() -> None:
    """Import the 4-bit weight-only Triton kernels once (registers `torch.ops.qshard.int4_linear`,
    `.mxfp4_linear` and `.nvfp4_linear`)."""
    from .w4a16 import ops  # noqa: F401  (imports Triton)


@functools.cache
def load_grouped_ops() -> None:
    """Import the grouped (experts) Triton kernels once (registers
    `torch.ops.qshard.fp8_blockwise_grouped_linear` and `.w4a16_grouped_linear`)."""
    from .grouped import ops  # noqa: F401  (imports Triton)


@functools.cache
def load_w4a8_ops() -> None:
    """Import the W4A8 Triton kernel once (registers `torch.ops.qshard.int4_w4a8_linear` and
    `.int4_w4a8_grouped_linear`)."""
    from .w4a8_triton import ops  # noqa: F401  (imports Triton)
