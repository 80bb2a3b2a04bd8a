"""What every layer asks about shards, without importing `torch.distributed.tensor` (a third of
a second at import, mostly sympy; no DTensor exists before it is imported): whether a tensor is
a DTensor, its local shard, and where `torch.chunk` cuts a dim among ranks (the tensor-parallel
styles, sliced checkpoint reads and the transformers integration cut alike)."""

from __future__ import annotations

import sys

import torch

__all__ = ["chunk_bounds", "is_dtensor", "local_tensor", "shard_cuts"]


def is_dtensor(t: torch.Tensor) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; any other tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def chunk_bounds(size: int, world: int, rank: int) -> tuple[int, int]:
    """[start, end) of `rank`'s chunk of `size` elements split `world` ways, as torch.chunk."""
    step = -(-size // world) if size else 0
    start = min(rank * step, size)
    return start, min(start + step, size)


def shard_cuts(size: int, world: int) -> list[int]:
    """Every interior boundary between the `world` chunks of `size` elements."""
    return sorted({chunk_bounds(size, world, r)[0] for r in range(1, world)} - {0, size})
