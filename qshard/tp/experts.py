"""Expert parallelism and tensor parallelism of an experts module's 3-D (quantized) weights.

An experts module (transformers 5.x, facts.md §8) holds `gate_up_proj` [E, 2I, H] and
`down_proj` [E, H, I] (gpt-oss: transposed [E, H, 2I] / [E, I, H], gate and up interleaved, with
per-expert biases) and is called as `experts(hidden [T, H], top_k_index [T, k], top_k_weights)`
with global expert ids. Two styles shard it over a 1-D mesh, for `qshard.tp.parallelize`:

- `ExpertParallel()`: each rank keeps E/world whole experts of every 3-D parameter and bias
  (DTensor `Shard(0)`, its own slice of the quantized tensor made into a compact copy). The
  forward maps the global ids to this rank's local ids (routes to other ranks' experts become
  the sentinel id `num_local_experts` with weight 0, which transformers' grouped_mm / batched_mm
  implementations skip, as in its `AllReduceEP`; under "eager", whose loops do not all accept
  the sentinel, local expert 0 with weight 0), runs the module's own experts implementation
  on the local experts only, and sums the ranks' partial outputs with one all-reduce.
- `ExpertTensorParallel()`: each rank keeps every expert's slice of the intermediate dim I:
  gate_up column-parallel (gate rows and up rows of the same units, so the gate stays paired;
  DTensor `_StridedShard(n, split_factor=2)` for the concatenated [gate; up] layout, a plain
  `Shard` for gpt-oss's interleaved one), down row-parallel (`Shard` of K) with one all-reduce,
  its bias added on rank 0 only. Cuts inside a quantized block are re-blocked exactly as dense
  shards are (`QTensor.realign` with every rank's boundaries: FP8 32x32 blocks at a 16-row shard
  become 16x16 blocks), or refused listing the sizes that work.

Why all-reduce and not all-to-all: qshard's tensor-parallel ranks all hold the same tokens (the
MoE block's input is replicated after a row-parallel attention output), so no token has to move
to reach its expert: each rank runs only its own experts' routes (the sentinel rows cost no
matmul), and one all-reduce of [T, H] combines them, in both styles. An all-to-all with sizes
(transformers' `AllToAllEP`) sends each route once instead, but its split sizes are read back
to the host every layer (a graph break or an unbacked-size graph under torch.compile, no CUDA
graph); it pays off only when ranks hold different tokens (data-parallel attention), which
qshard.tp does not do. The all-reduce is a functional collective named by the process group's
name, so the step compiles with fullgraph=True and its graph holds no DTensor (the forward runs
on a plain module holding the local shards).

Outputs equal one device's up to summation order: a token's top-k expert outputs are summed
across ranks instead of within one (exact for top-2 with EP: x + 0 + y), and a row-parallel
down projection's K parts are summed by the all-reduce.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from ..errors import ExpertParallelError, MisalignedSliceError
from ..qtensor import QTensor
from .styles import chunk_bounds, shard_cuts

__all__ = [
    "ExpertParallel",
    "ExpertParallelError",
    "ExpertTensorParallel",
    "ExpertsStyle",
    "experts_to_local",
    "local_experts",
]


# The experts module's parameter pairs, by name: (weight, its per-expert bias).
_GATE_UP, _DOWN = "gate_up_proj", "down_proj"
_BIAS = {_GATE_UP: "gate_up_proj_bias", _DOWN: "down_proj_bias"}

# Where the local module runs (not a submodule: not in state_dict, parameters() or named_modules).
_LOCAL_ATTR = "_qshard_local_experts"


def local_experts(module: nn.Module) -> nn.Module | None:
    """The plain module holding this rank's shards that a sharded experts module's forward runs
    (the module itself keeps DTensor parameters, for checkpoints), or None if not sharded here."""
    return module.__dict__.get(_LOCAL_ATTR)


def experts_to_local(model: nn.Module) -> nn.Module:
    """Give every experts module sharded here its local shards as plain parameters in place of
    the DTensors (what `qshard.tp.to_local` does for linears; run it before that, which refuses
    DTensors outside linears). Their forward already runs on the local shards; afterwards the
    model no longer carries placements for `qshard.save`. Returns the model."""
    for module in model.modules():
        local = local_experts(module)
        if local is not None:
            for name, param in list(module._parameters.items()):
                if isinstance(param, DTensor):
                    module._parameters[name] = local._parameters[name]
    return model


def _experts_weights(name: str, module: nn.Module, style: str) -> dict[str, bool]:
    """{3-D weight name: stored transposed} of a transformers experts module, or a typed error."""
    from ..api import _is_transformers_experts, experts_params

    params = experts_params(module)
    where = f"qshard.tp.{style}: {name or 'the model'!r}"
    if not params or not _is_transformers_experts(module):
        raise ExpertParallelError(
            f"{where} is a {type(module).__name__}, not a transformers experts module (a class "
            f"decorated with use_experts_implementation, called with (hidden_states, "
            f"top_k_index, top_k_weights)); point the entry at the model's '*.mlp.experts'"
        )
    if any(isinstance(p, DTensor) for p in module.parameters(recurse=False)):
        raise ExpertParallelError(f"{where} is already sharded; parallelize once")
    weights = dict(params)
    if set(weights) != {_GATE_UP, _DOWN} or not getattr(module, "has_gate", True):
        raise ExpertParallelError(
            f"{where} has expert weights {sorted(weights)}; {style} shards experts with "
            f"{_GATE_UP!r} and {_DOWN!r} (gated experts)"
        )
    if not hasattr(module, "num_experts"):
        raise ExpertParallelError(f"{where} has no num_experts attribute")
    return weights


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _place(module: nn.Module, name: str, local: torch.Tensor, mesh, placement, full) -> None:
    """Register `local` (this rank's shard of parameter `full`) as a DTensor parameter."""
    dtensor = DTensor.from_local(
        local, mesh, [placement], run_check=False, shape=full.shape, stride=full.stride()
    )
    module.register_parameter(name, nn.Parameter(dtensor, requires_grad=False))


def _compact(t: torch.Tensor) -> torch.Tensor:
    """A copy that owns only its own bytes (so the full weight can be freed)."""
    out = t.clone()
    return out.repack_for_device() if isinstance(out, QTensor) else out.contiguous()


class ExpertsStyle(ParallelStyle):
    """What the two styles share: checks before anything changes, the local module, the forward."""

    name = ""

    def check(self, name: str, module: nn.Module, world: int) -> None:
        """Raise ExpertParallelError if `module` cannot be sharded `world` ways (called by
        `qshard.tp.parallelize` for every entry before any module changes)."""
        raise NotImplementedError

    def _shard(self, module: nn.Module, mesh: DeviceMesh, local: nn.Module) -> None:
        raise NotImplementedError

    def _route(self, module, mesh, top_k_index, top_k_weights):
        return top_k_index, top_k_weights

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.ndim != 1:
            raise ExpertParallelError(
                f"qshard.tp.{self.name}: a {device_mesh.ndim}-D device mesh; pass a 1-D mesh"
            )
        self.check("", module, device_mesh.size())
        # A shallow twin (shared config, act_fn, hooks; its own parameter table) that holds the
        # local shards as plain tensors: the forward runs it, so a compiled graph sees no DTensor.
        local = copy.copy(module)
        local._parameters = dict(module._parameters)
        local.__dict__.pop("forward", None)
        self._shard(module, device_mesh, local)
        module.__dict__[_LOCAL_ATTR] = local
        group = device_mesh.get_group().group_name
        module.forward = _sharded_forward(self, module, device_mesh, local, group)
        return module


def _sharded_forward(style, module, mesh, local, group: str) -> Callable:
    def forward(hidden_states, top_k_index, top_k_weights):
        if isinstance(hidden_states, DTensor):
            hidden_states = hidden_states.to_local()
        if isinstance(top_k_weights, DTensor):
            top_k_weights = top_k_weights.to_local()
        top_k_index, top_k_weights = style._route(module, mesh, top_k_index, top_k_weights)
        out = local(hidden_states, top_k_index, top_k_weights)
        out = funcol.wait_tensor(funcol.all_reduce(out, "sum", group))
        return out.to(hidden_states.dtype)

    return forward


class ExpertParallel(ExpertsStyle):
    """Whole experts per rank (see the module docstring): every 3-D weight and per-expert bias
    `Shard(0)`, E / world experts each; E must divide evenly."""

    name = "ExpertParallel"

    def check(self, name: str, module: nn.Module, world: int) -> None:
        _experts_weights(name, module, self.name)
        experts = module.num_experts
        if experts % world:
            raise ExpertParallelError(
                f"qshard.tp.ExpertParallel: {name or 'the model'!r} has {experts} experts, which "
                f"do not split evenly over {world} ranks; expert-parallel sizes that work: "
                f"{_divisors(experts)} (or shard each expert with ExpertTensorParallel)"
            )

    def _shard(self, module: nn.Module, mesh: DeviceMesh, local: nn.Module) -> None:
        world, rank = mesh.size(), mesh.get_local_rank()
        experts = module.num_experts
        start, end = chunk_bounds(experts, world, rank)
        for pname, param in list(module.named_parameters(recurse=False)):
            if param.dim() == 0 or param.shape[0] != experts:
                continue  # not per expert: kept whole on every rank
            full = param.detach()
            if isinstance(full, QTensor):
                shard = _compact(full.slice_logical(0, start, end))
            else:
                shard = _compact(full[start:end])
            local._parameters[pname] = nn.Parameter(shard, requires_grad=False)
            _place(module, pname, shard, mesh, Shard(0), full)
        # transformers' EP convention: ids >= num_experts are routes to other ranks' experts.
        module.num_experts = local.num_experts = end - start
        module._is_expert_parallel = local._is_expert_parallel = True
        module.qshard_expert_range = (start, end)

    def _route(self, module, mesh, top_k_index, top_k_weights):
        start, end = module.qshard_expert_range
        ids = top_k_index - start
        off_rank = (ids < 0) | (ids >= end - start)
        # The sentinel id skips a route's rows in grouped_mm / batched_mm. transformers' eager
        # loops do not all take it (gpt-oss's one_hot has num_experts classes): there the route
        # goes to local expert 0 with weight 0, an exact zero, at the cost of wasted rows.
        eager = getattr(getattr(module, "config", None), "_experts_implementation", None) in (
            None,
            "eager",
        )
        ids = ids.masked_fill(off_rank, 0 if eager else end - start)
        return ids, top_k_weights.masked_fill(off_rank, 0.0)


def _gate_up_cuts(size: int, world: int, interleaved: bool) -> list[int]:
    """The N offsets that cut a [gate; up] (or interleaved) weight of `size` rows into every
    rank's paired shard."""
    units = size // 2
    cuts = shard_cuts(units, world)
    if interleaved:
        return [2 * c for c in cuts]
    return sorted({*cuts, units, *(units + c for c in cuts)})


def _gate_up_rows(size: int, world: int, rank: int, interleaved: bool) -> list[tuple[int, int]]:
    """[start, end) row ranges of `rank`'s paired gate/up shard, in the order it keeps them."""
    units = size // 2
    start, end = chunk_bounds(units, world, rank)
    if interleaved:
        return [(2 * start, 2 * end)]
    return [(start, end), (units + start, units + end)]


class ExpertTensorParallel(ExpertsStyle):
    """Every expert sliced along its intermediate dim I (see the module docstring): gate_up
    column-parallel with gate and up paired, down row-parallel, one all-reduce."""

    name = "ExpertTensorParallel"

    def check(self, name: str, module: nn.Module, world: int) -> None:
        weights = _experts_weights(name, module, self.name)
        interleaved = not getattr(module, "is_concatenated", True)
        quantized = {p: getattr(module, p) for p in weights}
        quantized = {p: w for p, w in quantized.items() if isinstance(w, QTensor)}
        problems = {p: _weight_problem(w, p, world, interleaved) for p, w in quantized.items()}
        failures = [f"{p}: {problem}" for p, problem in problems.items() if problem]
        if failures:
            working = [
                size
                for size in range(1, 65)
                if all(
                    _weight_problem(w, p, size, interleaved) is None for p, w in quantized.items()
                )
            ]
            raise ExpertParallelError(
                f"qshard.tp.ExpertTensorParallel: {name or 'the model'!r} at tensor-parallel size "
                f"{world} cuts quantized blocks: " + "; ".join(failures) + f". Sizes that work: "
                f"{working}; or re-quantize the experts with smaller blocks"
            )

    def _shard(self, module: nn.Module, mesh: DeviceMesh, local: nn.Module) -> None:
        world, rank = mesh.size(), mesh.get_local_rank()
        interleaved = not module.is_concatenated
        transposed = module.is_transposed
        for pname in (_GATE_UP, _DOWN):
            full = getattr(module, pname).detach()
            bias_name = _BIAS[pname]
            full_bias = getattr(module, bias_name, None)
            full_bias = None if full_bias is None else full_bias.detach()
            if pname == _GATE_UP:
                size = full.shape[2 if transposed else 1]
                rows = _gate_up_rows(size, world, rank, interleaved)
                if isinstance(full, QTensor):
                    realigned = full.realign(1, _gate_up_cuts(size, world, interleaved))
                    parts = [realigned.slice_logical(1, a, b) for a, b in rows]
                else:
                    parts = [full.narrow(2 if transposed else 1, a, b - a) for a, b in rows]
                outer = 2 if transposed else 1
                shard = _compact(torch.cat(parts, dim=outer) if len(parts) > 1 else parts[0])
                placement = Shard(outer) if interleaved else _paired(outer)
                bias = None
                if full_bias is not None:
                    bias = _compact(torch.cat([full_bias[:, a:b] for a, b in rows], dim=1))
                    bias_placement = Shard(1) if interleaved else _paired(1)
            else:
                size = full.shape[1 if transposed else 2]
                start, end = chunk_bounds(size, world, rank)
                outer = 1 if transposed else 2
                if isinstance(full, QTensor):
                    realigned = full.realign(2, shard_cuts(size, world))
                    shard = _compact(realigned.slice_logical(2, start, end))
                else:
                    shard = _compact(full.narrow(outer, start, end - start))
                placement = Shard(outer)
                bias, bias_placement = full_bias, Replicate()
            local._parameters[pname] = nn.Parameter(shard, requires_grad=False)
            _place(module, pname, shard, mesh, placement, full)
            if full_bias is not None:
                # Row-parallel: the partial sums are all-reduced, so the bias is added by rank 0.
                run_bias = bias if pname == _GATE_UP or rank == 0 else torch.zeros_like(bias)
                local._parameters[bias_name] = nn.Parameter(run_bias, requires_grad=False)
                _place(module, bias_name, bias, mesh, bias_placement, full_bias)
        for attr in ("intermediate_dim", "intermediate_size"):
            if isinstance(getattr(local, attr, None), int):
                start, end = chunk_bounds(getattr(local, attr), world, rank)
                setattr(local, attr, end - start)


def _paired(dim: int) -> Placement:
    """[gate; up] cut into world paired shards: the tensor is first split in two (gate, up),
    then each half is sharded; DTensor's _StridedShard with split_factor 2 says exactly that."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=2)


def _weight_problem(weight: QTensor, pname: str, world: int, interleaved: bool) -> str | None:
    """Why `weight` cannot be cut `world` ways as ExpertTensorParallel cuts it, or None."""
    if pname == _GATE_UP:
        size = weight.logical_shape[1]
        if size % 2:
            return f"{size} gate/up rows are not an even count"
        dim, cuts = 1, _gate_up_cuts(size, world, interleaved)
    else:
        dim, cuts = 2, shard_cuts(weight.logical_shape[2], world)
    try:
        weight.realign(dim, cuts)
    except MisalignedSliceError as e:
        return str(e)
    return None
