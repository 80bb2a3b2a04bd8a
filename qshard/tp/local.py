"""`to_local`: a tensor-parallel model's sharded linears as plain modules on their local shards,
for compiled inference (decode).

`parallelize` leaves DTensor weights behind torch's ParallelStyle hooks. That is what sharding,
saving and loading need, but a compiled graph over DTensor weights cannot be frozen: inductor's
freezing makes every graph input a constant, and the DeviceMesh that each DTensor carries is
an input it cannot hold (torch 2.13 with gloo: "cannot assign ... FakeScriptObject ... to buffer
'_frozen_param'"). Unfrozen, every call of the graph unwraps each quantized weight in Python,
which made the TP 1 int4 decode CPU-bound (H100: a 7.79-10.47 ms step against 3.29 ms frozen;
docs/decode.md, "Compiling the step: inductor freezing").

`to_local` swaps each sharded `nn.Linear` for a `LocalLinear` that holds the rank's shard as a
plain tensor (a QTensor for quantized weights), as gpt-fast does its tensor parallelism:
- column-wise (weight Shard(0)): `F.linear` on the shard, output the local columns, as the
  column-wise style with its default `use_local_output=True`;
- row-wise (weight Shard(1)): `F.linear` on the shard, the partial sums all-reduced by a
  functional collective named by the process group's name (a string, so a graph keeps no
  process-group object), then the bias, added once. NCCL, not torch's symmetric-memory
  one-shot all-reduce: in a CUDA graph on 2 H200s the two take 7.7 and 7.2 us for one token's
  4096 bf16 sums (bench/bench_all_reduce.py), and the one-shot buffer, allocated during the
  compiled step's warm-up, broke the CUDA graph trees' memory-pool check.
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
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from ..errors import ConfigError
from .experts import experts_to_local, local_experts
from .plan import APPLIED_STYLES

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
        out = funcol.wait_tensor(out)  # eager: an AsyncCollectiveTensor; compiled: a no-op
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        kind = "row-wise shard, all-reduced" if self.reduce_group else "local shard"
        return f"{super().extra_repr()}, {kind}"


def to_local(model: nn.Module) -> nn.Module:
    """Swap every `nn.Linear` that `qshard.tp.parallelize` sharded column- or row-wise for a
    `LocalLinear` on its shard, and give every experts module it sharded (ExpertParallel,
    ExpertTensorParallel) its local shards (`experts_to_local`); return the model (the new
    `LocalLinear` when `model` itself is the sharded linear: write
    `model = qshard.tp.to_local(model)`). Everything is checked before
    anything changes: a DTensor anywhere else (a sharded embedding or norm), a style with other
    than its default input / output layouts, or a subclass of nn.Linear is refused."""
    locals_: dict[int, LocalLinear] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if id(module) not in locals_ and _is_sharded_linear(module):
            locals_[id(module)] = _local_linear(name, module)
    for module_name, module in model.named_modules():
        if id(module) in locals_ or local_experts(module) is not None:  # experts: below
            continue
        for name, tensor in [
            *module.named_parameters(recurse=False),
            *module.named_buffers(recurse=False),
        ]:
            if isinstance(tensor, DTensor):
                where = f"{module_name}.{name}" if module_name else name
                raise ConfigError(
                    f"qshard.tp.to_local: {where!r} is a DTensor outside a column- or row-wise "
                    f"sharded nn.Linear; to_local makes only those local (keep the DTensor model, "
                    f"or shard only linears)"
                )
    experts_to_local(model)  # experts modules sharded by ExpertParallel / ExpertTensorParallel
    if id(model) in locals_:  # the model is the linear
        return locals_[id(model)]
    for module in list(model.modules()):
        for child_name, child in list(module._modules.items()):  # every name, shared ones too
            if child is not None and id(child) in locals_:
                setattr(module, child_name, locals_[id(child)])
    return model


def _is_sharded_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and isinstance(module.weight, DTensor)


def _local_linear(name: str, module: nn.Linear) -> LocalLinear:
    """The LocalLinear of a sharded linear, after checking that it was sharded the way
    LocalLinear computes: `qshard.tp.parallelize`'s column- or row-wise style with its default
    layouts (replicated input, local output columns; local input columns, replicated output)."""
    where = f"qshard.tp.to_local: {name or 'the model'!r}"
    if type(module) is not nn.Linear:
        raise ConfigError(
            f"{where} is a {type(module).__name__}, a subclass of nn.Linear whose forward "
            f"LocalLinear would drop; to_local swaps plain nn.Linear modules only"
        )
    style = APPLIED_STYLES.get(module)
    colwise, rowwise = isinstance(style, ColwiseParallel), isinstance(style, RowwiseParallel)
    if not (colwise or rowwise):
        raise ConfigError(
            f"{where} was not sharded column- or row-wise by qshard.tp.parallelize (style "
            f"{type(style).__name__ if style else None}); to_local takes models sharded by it "
            f"with 'colwise' / 'rowwise'"
        )
    default = _COLWISE_LAYOUTS if colwise else _ROWWISE_LAYOUTS
    layouts = (tuple(style.input_layouts), tuple(style.output_layouts), style.use_local_output)
    if layouts != default:
        raise ConfigError(
            f"{where}: its style has input / output layouts {layouts[0]} / {layouts[1]} and "
            f"use_local_output={layouts[2]}; LocalLinear computes only the defaults "
            f"{default[0]} / {default[1]}, use_local_output=True (keep the DTensor model for "
            f"other layouts)"
        )
    weight, bias = module.weight, module.bias
    expected_bias = Shard(0) if colwise else Replicate()
    if isinstance(bias, DTensor) and bias.placements != (expected_bias,):
        raise ConfigError(
            f"{where}: its bias is placed as {bias.placements}; a "
            f"{'column' if colwise else 'row'}-wise linear's bias must be {expected_bias}"
        )
    local_bias = bias.to_local() if isinstance(bias, DTensor) else bias
    group = None if colwise else weight.device_mesh.get_group().group_name
    return LocalLinear(weight.to_local(), local_bias, group)


_COLWISE_LAYOUTS = ((Replicate(),), (Shard(-1),), True)
_ROWWISE_LAYOUTS = ((Shard(-1),), (Replicate(),), True)
