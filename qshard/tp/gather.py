"""Gathering a sharded (DTensor) weight back to the full tensor, quantized ones included.

DTensor's own `full_tensor()` all-gathers the local tensor, which a quantized tensor cannot go
through (its inner tensors differ in shape and dtype). Here each inner tensor is gathered as raw
bytes, padded to the largest rank's size, and the pieces are joined with `torch.cat`, which is
exact for QTensors whose shard boundaries fall on their packing (what `qshard.tp` guarantees).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..errors import QShardError
from ..qtensor import QTensor

__all__ = ["full_tensor"]


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a DTensor (a collective: every rank of its mesh must call it); any
    other tensor as it is."""
    if not isinstance(tensor, DTensor):
        return tensor
    local = tensor.to_local()
    mesh = tensor.device_mesh
    strided = any(isinstance(p, _StridedShard) for p in tensor.placements)
    if not isinstance(local, QTensor) and not strided:
        return tensor.full_tensor()
    # Innermost mesh dim first: a [Shard(0), Shard(1)] tensor (experts over dim 0, each
    # expert's rows over dim 1) is whole along its rows after the first gather.
    for mesh_dim in reversed(range(mesh.ndim)):
        placement = tensor.placements[mesh_dim]
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, (Shard, _StridedShard)):
            raise QShardError(f"qshard: cannot gather a sharded tensor placed as {placement}")
        dim = placement.dim % local.dim()
        parts = _gathered_parts(local, dim, mesh.get_group(mesh_dim))
        if isinstance(placement, _StridedShard):
            # Each rank's part is split_factor equal pieces, one of each section of the full
            # dim (qshard's [gate; up] shards: this rank's gate rows, then its up rows).
            pieces = [_split(part, dim, placement.split_factor) for part in parts]
            parts = [
                rank_pieces[j] for j in range(placement.split_factor) for rank_pieces in pieces
            ]
        parts = [part for part in parts if part.shape[dim]]
        local = torch.cat(parts, dim) if len(parts) > 1 else parts[0] if parts else local
    return local


def _split(part: torch.Tensor, dim: int, pieces: int) -> list[torch.Tensor]:
    size = part.shape[dim] // pieces
    if isinstance(part, QTensor):
        logical = part.logical_dim(dim)
        return [part.slice_logical(logical, i * size, (i + 1) * size) for i in range(pieces)]
    return [part.narrow(dim, i * size, size) for i in range(pieces)]


def _gathered_parts(local: torch.Tensor, outer_dim: int, group) -> list[torch.Tensor]:
    """Every rank's `local` (ranks of `group`, in order), gathered as raw bytes: shards may
    differ in shape (uneven chunks), and a QTensor's inner tensors in shape and dtype."""
    world = dist.get_world_size(group)
    device = local.device
    # Every rank's shape: shards follow torch.chunk, but ask rather than assume.
    shape = local.logical_shape if isinstance(local, QTensor) else tuple(local.shape)
    mine = torch.tensor(shape, dtype=torch.int64, device=device)
    shapes = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(shapes, mine, group=group)
    shapes = [tuple(int(v) for v in s.tolist()) for s in shapes]
    if not isinstance(local, QTensor):
        gathered = _gather_bytes(local, [math.prod(s) * local.itemsize for s in shapes], group)
        return [b.view(local.dtype).reshape(s) for b, s in zip(gathered, shapes, strict=True)]
    local = local.canonical()  # every rank's part in one storage (int4: the code order)
    logical = local.logical_dim(outer_dim)
    attrs = local.attrs()
    specs = [local.inner_specs(shape, attrs) for shape in shapes]
    pieces: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    for name, tensor in local.inner_tensors().items():
        if local.inner_step(name, logical) is None:  # a value every rank's part shares
            # (never along experts: NVFP4's global scale is per expert)
            for piece in pieces:
                piece[name] = tensor
            continue
        sizes = [math.prod(spec[name][0]) * spec[name][1].itemsize for spec in specs]
        for rank, buffer in enumerate(_gather_bytes(tensor, sizes, group)):
            shape, dtype = specs[rank][name]
            pieces[rank][name] = buffer.view(dtype).reshape(shape)
    return [
        local.with_changes(inner, shape=shape, fresh=True)
        for inner, shape in zip(pieces, shapes, strict=True)
    ]


def _gather_bytes(tensor: torch.Tensor, sizes: list[int], group) -> list[torch.Tensor]:
    """Every rank's `tensor` as bytes (rank r's is sizes[r] long), padded to the largest."""
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=tensor.device)
    flat = tensor.contiguous().reshape(-1).view(torch.uint8)
    padded[: flat.numel()] = flat
    gathered = [torch.empty_like(padded) for _ in range(len(sizes))]
    dist.all_gather(gathered, padded, group=group)
    return [buffer[:size] for buffer, size in zip(gathered, sizes, strict=True)]
