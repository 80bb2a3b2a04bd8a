"""`to_local`: a tensor-parallel model's sharded linears as plain modules on their local shards,
for compiled inference (decode).

`parallelize` leaves DTensor weights behind torch's ParallelStyle hooks. That is what sharding,
saving and loading need, but a compiled graph over DTensor weights cannot be frozen: inductor's
freezing makes every graph input a constant, and the DeviceMesh that each DTensor carries is
an input it cannot hold (torch 2.11 and 2.13: "cannot assign ... FakeScriptObject ... to buffer
'_frozen_param'", docs/decode.md). Unfrozen, every call of the graph unwraps each quantized
weight in Python, which made the TP 1 int4 decode CPU-bound (docs/decode.md, session 7).

`to_local` swaps each sharded `nn.Linear` for a `LocalLinear` that holds the rank's shard as a
plain tensor (a QTensor for quantized weights), as gpt-fast does its tensor parallelism:
- column-wise (weight Shard(0)): `F.linear` on the shard, output the local columns, as the
  column-wise style with its default `use_local_output=True`;
- row-wise (weight Shard(1)): `F.linear` on the shard, the partial sums all-reduced by a
  functional collective named by the process group's name (a string, so a graph keeps no
  process-group object), then the bias, added once.
The graph of a compiled step then holds only tensors: it freezes, and no call unwraps a DTensor.
Run it last, after loading: the model is for inference (the shards are no longer DTensors, so
`qshard.save` and `full_tensor` no longer see their placements).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..errors import ConfigError

__all__ = ["LocalLinear", "to_local"]


class LocalLinear(nn.Linear):
    """One rank's shard of a tensor-parallel linear, as plain tensors; `reduce_group` (a process
    group's name) all-reduces a row-wise shard's partial output before the bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, reduce_group: str | None):
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.reduce_group = reduce_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reduce_group is None:
            return F.linear(x, self.weight, self.bias)
        out = funcol.all_reduce(F.linear(x, self.weight), "sum", self.reduce_group)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        kind = "row-wise shard, all-reduced" if self.reduce_group else "local shard"
        return f"{super().extra_repr()}, {kind}"


def to_local(model: nn.Module) -> nn.Module:
    """Swap every `nn.Linear` whose weight is a DTensor (what `qshard.tp.parallelize` made) for a
    `LocalLinear` on its shard; return the model (the new `LocalLinear` when `model` itself is
    the sharded linear). Everything is checked before anything changes: a DTensor anywhere else
    (a sharded embedding or norm, a 2-D mesh) is refused."""
    swaps = []
    for name, module in model.named_modules():
        local = _local_linear(name, module)
        if local is not None:
            swaps.append((name, local))
    swapped = {name for name, _ in swaps}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if isinstance(tensor, DTensor) and name.rpartition(".")[0] not in swapped:
            raise ConfigError(
                f"qshard.tp.to_local: {name!r} is a DTensor outside a sharded nn.Linear; "
                f"to_local makes only linears local (shard embeddings and norms no further, or "
                f"keep the DTensor model)"
            )
    if swaps and swaps[0][0] == "":  # the model is the linear
        return swaps[0][1]
    for name, local in swaps:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, local)
    return model


def _local_linear(name: str, module: nn.Module) -> LocalLinear | None:
    if not isinstance(module, nn.Linear) or not isinstance(module.weight, DTensor):
        return None
    weight = module.weight
    if weight.device_mesh.ndim != 1:
        raise ConfigError(
            f"qshard.tp.to_local: {name!r} is sharded over a {weight.device_mesh.ndim}-D mesh; "
            f"to_local takes the 1-D tensor-parallel mesh of qshard.tp.parallelize"
        )
    (placement,) = weight.placements
    bias = module.bias
    local_bias = bias.to_local() if isinstance(bias, DTensor) else bias
    if isinstance(placement, Replicate) or (isinstance(placement, Shard) and placement.dim == 0):
        return LocalLinear(weight.to_local(), local_bias, None)
    if isinstance(placement, Shard) and placement.dim in (1, -1):
        if isinstance(bias, DTensor) and not isinstance(bias.placements[0], Replicate):
            raise ConfigError(f"qshard.tp.to_local: {name!r}: a row-wise bias must be replicated")
        group = weight.device_mesh.get_group().group_name
        return LocalLinear(weight.to_local(), local_bias, group)
    raise ConfigError(f"qshard.tp.to_local: {name!r}: weight placed as {placement}")
