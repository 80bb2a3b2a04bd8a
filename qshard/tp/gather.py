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

from ..errors import QShardError
from ..qtensor import QTensor

__all__ = ["full_tensor"]


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a DTensor (a collective: every rank of its mesh must call it); any
    other tensor as it is."""
    if not isinstance(tensor, DTensor):
        return tensor
    local = tensor.to_local()
    if not isinstance(local, QTensor):
        return tensor.full_tensor()
    if tensor.device_mesh.ndim != 1:
        raise QShardError(
            f"qshard: gathering a quantized DTensor on a {tensor.device_mesh.ndim}-D mesh is not "
            f"supported; shard quantized weights over a 1-D tensor-parallel mesh"
        )
    (placement,) = tensor.placements
    if isinstance(placement, Replicate):
        return local
    if not isinstance(placement, Shard):
        raise QShardError(f"qshard: cannot gather a quantized DTensor placed as {placement}")
    return _gather_shards(local, placement.dim % local.dim(), tensor.device_mesh.get_group())


def _gather_shards(local: QTensor, outer_dim: int, group) -> QTensor:
    logical = local.logical_dim(outer_dim)
    world = dist.get_world_size(group)
    device = local.device
    # Every rank's logical shape: shards follow torch.chunk, but ask rather than assume.
    mine = torch.tensor(local.logical_shape, dtype=torch.int64, device=device)
    shapes = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(shapes, mine, group=group)
    shapes = [tuple(int(v) for v in s.tolist()) for s in shapes]
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
        padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
        flat = tensor.contiguous().reshape(-1).view(torch.uint8)
        padded[: flat.numel()] = flat
        gathered = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded, group=group)
        for rank, (buffer, size) in enumerate(zip(gathered, sizes, strict=True)):
            shape, dtype = specs[rank][name]
            pieces[rank][name] = buffer[:size].view(dtype).reshape(shape)
    parts = [
        local.with_changes(inner, shape=shape, fresh=True)
        for inner, shape in zip(pieces, shapes, strict=True)
        if shape[logical]
    ]
    if len(parts) <= 1:
        return parts[0] if parts else local
    return torch.cat(parts, outer_dim)
