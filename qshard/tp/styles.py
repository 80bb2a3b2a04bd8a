"""Quantization-aware tensor-parallel styles for nn.Linear.

They are torch's `ColwiseParallel` / `RowwiseParallel` with two changes:

- A quantized weight is sharded by local slicing on every rank (`DTensor.from_local`), never
  scattered, because a quantized tensor cannot go through a collective: every rank must hold
  the same full quantized weight (quantize after loading the same checkpoint). It is first
  re-aligned for all the shard boundaries at once (`QTensor.realign`: FP8 re-blocks to the
  largest block that divides every boundary), so every rank holds the same packing, then each
  rank keeps a copy of its own slice. Plain parameters go through torch's `distribute_tensor`
  as in the stock styles (`src_data_rank` included).
- The row-wise style tells DTensor the full input width, so a row-wise layer also takes the
  uneven shards a column-wise layer produces (torch assumes even ones).

Shards follow `torch.chunk` (and DTensor's `Shard`) semantics: ceil(size / world) per rank, the
last ones smaller or empty. Input and output handling is torch's, unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from ..errors import QShardError
from ..qtensor import QTensor
from ..shards import chunk_bounds, shard_cuts

__all__ = [
    "QuantColwiseParallel",
    "QuantRowwiseParallel",
    "chunk_bounds",
    "param_placements",
    "shard_cuts",
]


def _mesh_rank(mesh: DeviceMesh) -> tuple[int, int]:
    if mesh.ndim != 1:
        raise QShardError(
            f"qshard.tp: a {mesh.ndim}-D device mesh; tensor parallelism takes a 1-D mesh (pass "
            f"the TP sub-mesh, e.g. mesh['tp'])"
        )
    return mesh.size(), mesh.get_local_rank()


def shard_locally(tensor: torch.Tensor, mesh: DeviceMesh, placement: Placement) -> DTensor:
    """This rank's shard of `tensor` (the same full tensor on every rank) as a DTensor."""
    world, rank = _mesh_rank(mesh)
    if isinstance(placement, Replicate):
        local = tensor
    else:
        assert isinstance(placement, Shard), placement
        dim = placement.dim % tensor.dim()
        if isinstance(tensor, QTensor):
            tensor = tensor.realign(tensor.logical_dim(dim), shard_cuts(tensor.shape[dim], world))
        start, end = chunk_bounds(tensor.shape[dim], world, rank)
        # A copy, so that the full weight can be freed once every module is sharded.
        local = tensor.narrow(dim, start, end - start).clone().repack_for_device()
    return DTensor.from_local(
        local, mesh, [placement], run_check=False, shape=tensor.shape, stride=tensor.stride()
    )


def _shard_parameter(style, module: nn.Module, name: str, mesh: DeviceMesh, placement):
    param = getattr(module, name)
    if isinstance(param, DTensor):  # loaded as this rank's shard by qshard.load(mesh=, plan=)
        if tuple(param.placements) != (placement,):
            raise QShardError(
                f"qshard.tp: {name!r} of a {type(module).__name__} is placed {param.placements}; "
                f"{type(style).__name__} places it ({placement},)"
            )
        return
    param = param.detach()
    if isinstance(param, QTensor):
        dtensor = shard_locally(param, mesh, placement)
    else:
        dtensor = distribute_tensor(param, mesh, [placement], src_data_rank=style.src_data_rank)
    module.register_parameter(name, nn.Parameter(dtensor, requires_grad=param.requires_grad))


# Hook-only styles leave parameters alone; SequenceParallel wraps each full local parameter as
# a replicated DTensor itself (no collective): a sharded load reads their parameters whole.
_WHOLE_PARAMETER_STYLES = (
    SequenceParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    PrepareModuleInputOutput,
)


def param_placements(style: ParallelStyle, module: nn.Module) -> dict[str, Placement]:
    """{parameter name: placement} that `style` gives `module`'s parameters (what a sharded load
    reads for each rank); QShardError for a style that places parameters in a way not known
    here."""
    if hasattr(style, "load_placements"):  # experts styles (qshard.tp.experts)
        return style.load_placements(module)
    names = [name for name, _ in module.named_parameters()]
    linear = isinstance(module, nn.Linear)
    if isinstance(style, QuantColwiseParallel):
        table = {"weight": Shard(0), "bias": Shard(0)} if linear else {"weight": Shard(1)}
    elif isinstance(style, QuantRowwiseParallel):
        table = {"weight": Shard(1), "bias": Replicate()} if linear else {"weight": Shard(0)}
    elif isinstance(style, _WHOLE_PARAMETER_STYLES):
        table = {}
    else:
        raise QShardError(
            f"qshard.load: the TP style {type(style).__name__} places parameters in a way qshard "
            f"does not know; load without mesh and plan, then call qshard.tp.parallelize"
        )
    return {name: placement for name, placement in table.items() if name in names}


class QuantColwiseParallel(ColwiseParallel):
    """ColwiseParallel for plain and quantized weights: weight and bias Shard(0) (output dim)."""

    def _partition_linear_fn(self, name, module, device_mesh):
        for param_name in ("weight", "bias"):
            if getattr(module, param_name, None) is not None:
                _shard_parameter(self, module, param_name, device_mesh, Shard(0))


class QuantRowwiseParallel(RowwiseParallel):
    """RowwiseParallel for plain and quantized weights: weight Shard(1) (input dim), bias
    replicated (added once, after the partial sums are reduced)."""

    def _partition_linear_fn(self, name, module, device_mesh):
        _shard_parameter(self, module, "weight", device_mesh, Shard(1))
        if getattr(module, "bias", None) is not None:
            _shard_parameter(self, module, "bias", device_mesh, Replicate())

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        x = inputs[0]
        layout = input_layouts[0]
        last = isinstance(layout, Shard) and layout.dim in (-1, x.dim() - 1)
        if not isinstance(x, DTensor) and last and isinstance(mod, nn.Linear):
            # The shard sizes of a column-wise layer before it may be uneven (torch.chunk).
            shape = (*x.shape[:-1], mod.in_features)
            stride = torch.empty(shape, device="meta").stride()
            x = DTensor.from_local(
                x, device_mesh, input_layouts, run_check=False, shape=shape, stride=stride
            )
        return RowwiseParallel._prepare_input_fn(
            input_layouts, desired_input_layouts, mod, (x, *inputs[1:]), device_mesh
        )
