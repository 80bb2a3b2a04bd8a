"""Expert parallelism and tensor parallelism of an experts module's 3-D (quantized) weights.

An experts module (transformers 5.x, docs/design.md, "Experts in transformers") holds
`gate_up_proj` [E, 2I, H] and
`down_proj` [E, H, I] (gpt-oss: transposed [E, H, 2I] / [E, I, H], gate and up interleaved, with
per-expert biases) and is called as `experts(hidden [T, H], top_k_index [T, k], top_k_weights)`
with global expert ids. The styles, for `qshard.tp.parallelize` over a 1-D mesh:

- `ExpertParallel()`: each rank keeps E/world whole experts of every 3-D parameter and bias
  (DTensor `Shard(0)`, its own slice of the quantized tensor made into a compact copy). With
  the default dispatch "all_reduce" every rank holds the same tokens (the MoE block's input is
  replicated after a row-parallel attention output): the forward maps the global ids to this
  rank's local ids (routes to other ranks' experts become the sentinel id `num_local_experts`
  with weight 0, which transformers' grouped_mm / batched_mm implementations skip, as in its
  `AllReduceEP`; under "eager", whose loops do not all accept the sentinel, local expert 0 with
  weight 0), runs the module's own experts implementation on the local experts only, and sums
  the ranks' partial outputs with one all-reduce: no token moves, nothing is read back to the
  host, the step compiles with fullgraph=True and freezes.
- `ExpertParallel(dispatch="all_to_all")`: each rank holds its own tokens (data-parallel
  attention): every (token, expert) route is sent to its expert's rank and the result back by
  two all-to-alls (transformers' `AllToAllEP`), whose split sizes are read to the host once per
  layer. On tokens the ranks share it would run every route once per rank: use "all_reduce".
- `ExpertTensorParallel()`: each rank keeps every expert's slice of the intermediate dim I:
  gate_up column-parallel (gate rows and up rows of the same units, so the gate stays paired;
  DTensor `_StridedShard(n, split_factor=2)` for the concatenated [gate; up] layout, a plain
  `Shard` for gpt-oss's interleaved one), down row-parallel (`Shard` of K) with one all-reduce,
  its bias added on rank 0 only. Cuts inside a quantized block are re-blocked exactly as dense
  shards are (`QTensor.realign` with every rank's boundaries: FP8 32x32 blocks at a 16-row shard
  become 16x16 blocks), or refused listing the sizes that work.
- `ExpertParallel(tensor_parallel=t)`: both (EP x TP): world / t groups of t consecutive ranks,
  experts split over the groups, each expert's I over the ranks of its group, placed on a 2-D
  mesh of the same ranks; one all-reduce over all of them.

The all-reduce is a functional collective named by the process group's name, so the graph
holds no DTensor (the forward runs on a plain module holding the local shards). Outputs equal
one device's up to summation order: a token's top-k expert outputs are summed across ranks
instead of within one, and a row-parallel down projection's K parts by the all-reduce. With
gradients enabled, the shared inputs' gradients are all-reduced in the backward.

Size: about 660 lines; the styles, both dispatches and the expert-tensor-parallel cut share
one routing state (which rank holds which expert, which tokens it sums) and are kept together
so that the protocol each rank follows reads in one file.
"""

from __future__ import annotations

import copy
import enum
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from ..errors import ExpertParallelError, InputMismatchError, MisalignedSliceError, QShardError
from ..qtensor import QTensor
from ..targets import experts_params, is_transformers_experts
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
    params = experts_params(module)
    where = f"qshard.tp.{style}: {name or 'the model'!r}"
    if not params or not is_transformers_experts(module):
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


def _compact(t: torch.Tensor) -> torch.Tensor:
    """A copy that owns only its own bytes (so the full weight can be freed)."""
    out = t.clone()
    return out.repack_for_device() if isinstance(out, QTensor) else out.contiguous()


class _Placed(NamedTuple):
    """One parameter of a sharded experts module: this rank's shard as the DTensor parameter
    stores it (`stored`, with its `placements` on the style's mesh) and as the local forward
    runs it (`run`: the same tensor, except a row-parallel bias, which only one rank adds)."""

    stored: torch.Tensor
    placements: tuple[Placement, ...]
    run: torch.Tensor


class ExpertsStyle(ParallelStyle):
    """What the styles share: checks before anything changes, the local module, the forward."""

    name = ""

    def check(self, name: str, module: nn.Module, world: int) -> None:
        """Raise ExpertParallelError if `module` cannot be sharded `world` ways (called by
        `qshard.tp.parallelize` for every entry before any module changes)."""
        raise NotImplementedError

    def _placed(self, module: nn.Module, world: int, rank: int) -> dict[str, _Placed]:
        """Rank `rank`'s shard of every parameter this style shards (the rest stay whole)."""
        raise NotImplementedError

    def check_mesh(self, mesh: DeviceMesh) -> None:
        """Raise ExpertParallelError if this style cannot shard over `mesh` (called by
        `qshard.tp.parallelize` and a sharded `qshard.load` before any module changes)."""
        if mesh.ndim != 1:
            raise ExpertParallelError(
                f"qshard.tp.{self.name}: a {mesh.ndim}-D device mesh; pass a 1-D mesh"
            )
        self._param_mesh(mesh)

    def _param_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh the DTensor parameters live on (`_placed`'s placements index it)."""
        return mesh

    def _resize(self, module: nn.Module, local: nn.Module, world: int, rank: int) -> None:
        """Set the size attributes the experts forward reads to this rank's shard's."""

    def _run(self, module, local, group: str, world: int, hidden, top_k_index, top_k_weights):
        """This rank's part of the experts' output for `hidden`, summed over the ranks."""
        _check_same_tokens(self, hidden, group)
        if not (torch.is_grad_enabled() and (hidden.requires_grad or top_k_weights.requires_grad)):
            top_k_index, top_k_weights = self._route(module, top_k_index, top_k_weights)
            out = local(hidden, top_k_index, top_k_weights)
            return funcol.wait_tensor(funcol.all_reduce(out, "sum", group))
        # As Megatron's TP: each rank differentiates through its own experts (and routes) only,
        # so the inputs' gradients are partial sums, all-reduced in the backward; the output's
        # sum passes its gradient through unchanged (every rank gets the same one). torch's
        # own functional all-reduce sums gradients in its backward (2.13): not used here.
        hidden = _SumGradients.apply(hidden, group)
        top_k_weights = _SumGradients.apply(top_k_weights, group)  # before the routes' mask
        top_k_index, top_k_weights = self._route(module, top_k_index, top_k_weights)
        return _SumOutputs.apply(local(hidden, top_k_index, top_k_weights), group)

    def _route(self, module, top_k_index, top_k_weights):
        return top_k_index, top_k_weights

    def load_placements(self, module: nn.Module) -> dict[str, Placement]:
        """{parameter: placement} that a sharded `qshard.load` reads for each rank (it then
        calls `_apply(..., loaded=True)`), or QShardError if this style is not loaded so."""
        raise QShardError(
            f"qshard.load: {self!r} is not applied while loading; load the experts without "
            f"mesh and plan, then call qshard.tp.parallelize (or shard by whole experts: "
            f"ExpertParallel() reads only each rank's experts)"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh, loaded: bool = False):
        """Shard `module` over `device_mesh`; `loaded`: its parameters are the DTensors a
        sharded `qshard.load` read by `load_placements` (checked there, before reading)."""
        world, rank = device_mesh.size(), device_mesh.get_local_rank()
        if not loaded:
            self.check_mesh(device_mesh)
            self.check("", module, world)
        placed = self._placed(module, world, rank)
        mesh = self._param_mesh(device_mesh)
        # A shallow twin (shared config, act_fn, hooks; its own parameter table) that holds the
        # local shards as plain tensors: the forward runs it, so a compiled graph sees no DTensor.
        local = copy.copy(module)
        local._parameters = dict(module._parameters)
        local.__dict__.pop("forward", None)
        for pname, part in placed.items():
            full = module._parameters[pname].detach()
            local._parameters[pname] = nn.Parameter(part.run, requires_grad=False)
            dtensor = DTensor.from_local(
                part.stored,
                mesh,
                part.placements,
                run_check=False,
                shape=full.shape,
                stride=full.stride(),
            )
            module.register_parameter(pname, nn.Parameter(dtensor, requires_grad=False))
        self._resize(module, local, world, rank)
        module.__dict__[_LOCAL_ATTR] = local
        group = device_mesh.get_group().group_name
        module.forward = _sharded_forward(self, module, local, group, world)
        return module


def _check_same_tokens(style: ExpertsStyle, hidden: torch.Tensor, group: str) -> None:
    """Raise InputMismatchError on every rank if the ranks hold different numbers of tokens:
    the all-reduce that sums their outputs needs the same tokens everywhere (an all-reduce of
    unequal sizes hangs on NCCL). Eager only: one small all-reduce and one read to the host per
    call, which a compiled graph does not pay (there the inputs are the caller's to keep equal)."""
    if torch.compiler.is_compiling() or (
        hidden.is_cuda and torch.cuda.is_current_stream_capturing()
    ):  # (a graph cannot read the host)
        return
    count = hidden.numel()
    counts = torch.tensor([count, -count], dtype=torch.int64, device=hidden.device)
    most, minus_least = funcol.wait_tensor(funcol.all_reduce(counts, "max", group)).tolist()
    if most != -minus_least:
        raise InputMismatchError(
            f"qshard.tp.{style!r}: the ranks hold different tokens (hidden of {count} elements "
            f"here, {-minus_least} to {most} over the ranks); the all-reduce dispatch needs the "
            f"same tokens on every rank (a replicated MoE input); for each rank's own tokens "
            f"use ExpertParallel(dispatch='all_to_all')"
        )


class _SumGradients(torch.autograd.Function):
    """The identity, whose backward sums the gradient over the group's ranks."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: str) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None


class _SumOutputs(torch.autograd.Function):
    """The sum over the group's ranks, whose backward is the identity."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: str) -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_reduce(tensor, "sum", group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _sharded_forward(style, module, local, group: str, world: int) -> Callable:
    def forward(hidden_states, top_k_index, top_k_weights):
        if isinstance(hidden_states, DTensor):
            hidden_states = hidden_states.to_local()
        if isinstance(top_k_weights, DTensor):
            top_k_weights = top_k_weights.to_local()
        out = style._run(module, local, group, world, hidden_states, top_k_index, top_k_weights)
        return out.to(hidden_states.dtype)

    return forward


class Dispatch(enum.Enum):
    """How ExpertParallel's ranks combine their experts' outputs (see its docstring)."""

    ALL_REDUCE = "all_reduce"
    ALL_TO_ALL = "all_to_all"


_DISPATCHES = tuple(d.value for d in Dispatch)
# The 2-D (experts x their rows) mesh made from each 1-D mesh, by tensor_parallel.
_TWO_D_MESHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class ExpertParallel(ExpertsStyle):
    """Whole experts per rank (see the module docstring): every 3-D weight and per-expert bias
    `Shard(0)`, E / (world / tensor_parallel) experts each; E must divide evenly.

    tensor_parallel: ranks that share each expert, cutting its intermediate dim as
        ExpertTensorParallel does (EP x TP: world = ep x tensor_parallel, consecutive ranks
        share experts); 1 keeps experts whole.
    dispatch: "all_reduce" (every rank holds the same tokens: the routes to other ranks'
        experts are skipped and one all-reduce sums the outputs) or "all_to_all" (each rank
        holds its own tokens, as with data-parallel attention: each route is sent to its
        expert's rank and the result back; tensor_parallel 1 only).
    """

    name = "ExpertParallel"

    def __init__(self, *, tensor_parallel: int = 1, dispatch: str | Dispatch = "all_reduce"):
        super().__init__()
        if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int):
            raise ExpertParallelError(
                f"qshard.tp.ExpertParallel: tensor_parallel={tensor_parallel!r}; pass a positive "
                f"int (the ranks that share each expert; 1 keeps experts whole)"
            )
        if tensor_parallel < 1:
            raise ExpertParallelError(
                f"qshard.tp.ExpertParallel: tensor_parallel={tensor_parallel}; pass 1 or more"
            )
        if dispatch not in _DISPATCHES and not isinstance(dispatch, Dispatch):
            raise ExpertParallelError(
                f"qshard.tp.ExpertParallel: dispatch={dispatch!r}; pass one of {_DISPATCHES}"
            )
        dispatch = Dispatch(dispatch)
        if dispatch is Dispatch.ALL_TO_ALL and tensor_parallel != 1:
            raise ExpertParallelError(
                f"qshard.tp.ExpertParallel: dispatch='all_to_all' with tensor_parallel="
                f"{tensor_parallel}; the all-to-all sends each route to one rank, so each expert "
                f"must be whole there: use tensor_parallel=1, or dispatch='all_reduce'"
            )
        self.tensor_parallel = tensor_parallel
        self.dispatch = dispatch

    def __repr__(self) -> str:
        return (
            f"ExpertParallel(tensor_parallel={self.tensor_parallel}, "
            f"dispatch={self.dispatch.value!r})"
        )

    def check(self, name: str, module: nn.Module, world: int) -> None:
        _experts_weights(name, module, self.name)
        where = f"qshard.tp.ExpertParallel: {name or 'the model'!r}"
        tp = self.tensor_parallel
        if world % tp:
            raise ExpertParallelError(
                f"{where}: tensor_parallel={tp} does not divide the {world} ranks of the mesh; "
                f"values that do: {_divisors(world)}"
            )
        experts, ep = module.num_experts, world // tp
        if experts % ep:
            on = f"{ep} expert-parallel groups ({world} ranks / tensor_parallel {tp})"
            raise ExpertParallelError(
                f"{where} has {experts} experts, which do not split evenly over "
                f"{on if tp > 1 else f'{world} ranks'}; expert-parallel sizes that work: "
                f"{_divisors(experts)} (or shard each expert with ExpertTensorParallel)"
            )
        if tp > 1:
            _check_tensor_parallel(
                name, module, tp, f"qshard.tp.ExpertParallel(tensor_parallel={tp})"
            )

    def load_placements(self, module: nn.Module) -> dict[str, Placement]:
        if self.tensor_parallel != 1:
            return super().load_placements(module)
        return {name: Shard(0) for name, _ in _per_expert(module)}

    def _ranks(self, world: int, rank: int) -> tuple[int, int, int]:
        """(expert-parallel size, this rank's expert group, its rank within the group)."""
        return world // self.tensor_parallel, *divmod(rank, self.tensor_parallel)

    def _param_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        if self.tensor_parallel == 1:
            return mesh
        # The same ranks as a 2-D mesh: experts split over dim 0, each expert over dim 1.
        # Made once per (mesh, tensor_parallel): each makes process groups.
        made = _TWO_D_MESHES.setdefault(mesh, {})
        if self.tensor_parallel not in made:
            made[self.tensor_parallel] = self._two_d_mesh(mesh)
        return made[self.tensor_parallel]

    def _two_d_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        sizes = (mesh.size() // self.tensor_parallel, self.tensor_parallel)
        names = ("qshard_ep", "qshard_etp")
        if mesh.mesh_dim_names:
            return mesh._unflatten(0, sizes, names)
        # An unnamed mesh cannot be unflattened; a new mesh of the same ranks can be built
        # (every rank of the default group makes the subgroups) when it spans the whole world.
        if mesh.size() != torch.distributed.get_world_size():
            raise ExpertParallelError(
                f"qshard.tp.ExpertParallel(tensor_parallel={self.tensor_parallel}): an unnamed "
                f"mesh of {mesh.size()} of the {torch.distributed.get_world_size()} ranks; name "
                f"its dim (init_device_mesh(..., mesh_dim_names=('tp',)), or a named sub-mesh)"
            )
        return DeviceMesh(mesh.device_type, mesh.mesh.view(sizes), mesh_dim_names=names)

    def _placed(self, module: nn.Module, world: int, rank: int) -> dict[str, _Placed]:
        ep, group, group_rank = self._ranks(world, rank)
        experts = module.num_experts
        start, end = chunk_bounds(experts, ep, group)
        sliced = {}
        for pname, param in _per_expert(module):  # the rest are kept whole on every rank
            full = param.detach()
            if isinstance(full, DTensor):  # read by qshard.load: this rank's experts already
                sliced[pname] = full.to_local()
                continue
            sliced[pname] = (
                full.slice_logical(0, start, end) if isinstance(full, QTensor) else full[start:end]
            )
        if self.tensor_parallel == 1:
            return {p: _Placed(shard, (Shard(0),), shard) for p, shard in _compacts(sliced).items()}
        placed = {p: _Placed(s, (Shard(0), Replicate()), s) for p, s in _compacts(sliced).items()}
        cut = _tensor_parallel_shards(module, sliced, self.tensor_parallel, group_rank)
        for pname, part in cut.items():
            placed[pname] = _Placed(part.stored, (Shard(0), *part.placements), part.run)
        return placed

    def _resize(self, module: nn.Module, local: nn.Module, world: int, rank: int) -> None:
        ep, group, group_rank = self._ranks(world, rank)
        start, end = chunk_bounds(module.num_experts, ep, group)
        # transformers' EP convention: ids >= num_experts are routes to other ranks' experts.
        module.num_experts = local.num_experts = end - start
        module._is_expert_parallel = local._is_expert_parallel = True
        module.qshard_expert_range = local.qshard_expert_range = (start, end)
        if self.tensor_parallel > 1:
            _resize_intermediate(local, self.tensor_parallel, group_rank)

    def _route(self, module, top_k_index, top_k_weights):
        start, end = module.qshard_expert_range
        ids = top_k_index - start
        off_rank = (ids < 0) | (ids >= end - start)
        # The sentinel id skips a route's rows in grouped_mm / batched_mm. transformers' eager
        # loops do not all take it (gpt-oss's one_hot has num_experts classes): there the route
        # goes to local expert 0 with weight 0, an exact zero, at the cost of wasted rows.
        ids = ids.masked_fill(off_rank, 0 if _runs_eager(module) else end - start)
        return ids, top_k_weights.masked_fill(off_rank, 0.0)

    def _run(self, module, local, group: str, world: int, hidden, top_k_index, top_k_weights):
        if self.dispatch is Dispatch.ALL_REDUCE:
            return super()._run(module, local, group, world, hidden, top_k_index, top_k_weights)
        return _all_to_all_experts(local, group, world, hidden, top_k_index, top_k_weights)


def _per_expert(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The module's parameters with a leading experts dim (what ExpertParallel splits)."""
    experts = module.num_experts
    params = module.named_parameters(recurse=False)
    return [(name, p) for name, p in params if p.dim() and p.shape[0] == experts]


def _runs_eager(module: nn.Module) -> bool:
    """Whether the module's forward may not take the sentinel id (transformers' eager loops);
    a module that says it skips them (`skips_sentinel_ids`, qshard.models' experts) does."""
    if getattr(module, "skips_sentinel_ids", False):
        return False
    implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
    return implementation in (None, "eager")


def _compacts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: _compact(t) for name, t in tensors.items()}


_BAD_IDS = (
    "qshard.tp.ExpertParallel(dispatch='all_to_all'): top_k_index holds expert ids outside "
    "[0, experts) on some rank; route to the model's experts"
)


def _all_to_all_experts(local, group: str, world: int, hidden, top_k_index, top_k_weights):
    """Each rank's own tokens through the experts of every rank: each (token, expert) route is
    sent to its expert's rank (sorted by expert, so a rank receives its experts' rows grouped),
    run there top-1 with unit weight, sent back, and weighted and summed per token here.

    The split sizes are read back to the host once per call (one sync; torch.compile traces
    them as unbacked sizes with fullgraph=True, and breaks the graph there otherwise). A route
    to an expert id outside [0, E) on any rank makes every rank raise before the tokens move
    (the counts exchange carries each rank's count of bad ids, so no rank is left waiting in a
    collective): InputMismatchError, or in compiled code torch's RuntimeError of a failed
    runtime assertion."""
    experts_here = local.num_experts
    experts = experts_here * world
    tokens, top_k = top_k_index.shape
    ids = top_k_index.reshape(-1).long()
    bad = (ids < 0) | (ids >= experts)
    ids = ids.masked_fill(bad, 0)
    order = torch.argsort(ids, stable=True)
    counts = torch.zeros(experts, dtype=torch.int64, device=ids.device)
    counts = counts.scatter_add_(0, ids, torch.ones_like(ids)).view(world, experts_here)
    # Every destination also gets this rank's count of bad ids, in a last column.
    sent = torch.cat([counts, bad.sum().expand(world, 1)], dim=1)
    received = funcol.wait_tensor(funcol.all_to_all_single(sent.reshape(-1), None, None, group))
    received = received.view(world, experts_here + 1)
    recv_counts = received[:, :experts_here]
    sizes = torch.cat([counts.sum(1), recv_counts.sum(1), received[:, -1]]).tolist()
    send_sizes, recv_sizes, bad_counts = sizes[:world], sizes[world : 2 * world], sizes[2 * world :]
    if torch.compiler.is_compiling():  # the counts are symbolic: a check in the graph
        torch._check(sum(bad_counts) == 0, lambda: _BAD_IDS)
    elif any(bad_counts):
        raise InputMismatchError(f"{_BAD_IDS} (experts: {experts}; counts by rank: {bad_counts})")
    rows = funcol.all_to_all_single_autograd(hidden[order // top_k], recv_sizes, send_sizes, group)
    rows = funcol.wait_tensor(rows)
    local_ids = torch.arange(experts_here, device=ids.device).repeat(world)
    local_ids = local_ids.repeat_interleave(recv_counts.reshape(-1), output_size=sum(recv_sizes))
    out = local(rows, local_ids[:, None], rows.new_ones(len(local_ids), 1))
    back = funcol.all_to_all_single_autograd(out, send_sizes, recv_sizes, group)
    back = funcol.wait_tensor(back)
    routes = torch.empty_like(back).index_copy_(0, order, back)
    # Weighted and summed in the experts' output dtype, as transformers' experts on one device
    # do: bf16 outputs then equal one device's bit for bit (measured; fp32 weighting here
    # differed from it by 50 dB SQNR, which FP8 activation quantization downstream amplified
    # to 26 dB in the logits of the tiny test model).
    routes = routes.view(tokens, top_k, hidden.shape[-1])
    return (routes * top_k_weights.to(routes.dtype).unsqueeze(-1)).sum(1)


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


def _check_tensor_parallel(name: str, module: nn.Module, world: int, style: str) -> None:
    """ExpertParallelError if cutting each expert's intermediate dim `world` ways cuts a
    quantized block that cannot be re-blocked, naming the sizes that work."""
    weights = _experts_weights(name, module, style)
    interleaved = not getattr(module, "is_concatenated", True)
    quantized = {p: getattr(module, p) for p in weights}
    quantized = {p: w for p, w in quantized.items() if isinstance(w, QTensor)}
    problems = {p: _weight_problem(w, p, world, interleaved) for p, w in quantized.items()}
    failures = [f"{p}: {problem}" for p, problem in problems.items() if problem]
    if failures:
        working = [
            size
            for size in range(1, 65)
            if all(_weight_problem(w, p, size, interleaved) is None for p, w in quantized.items())
        ]
        raise ExpertParallelError(
            f"{style}: {name or 'the model'!r} at tensor-parallel size {world} cuts quantized "
            f"blocks: " + "; ".join(failures) + f". Sizes that work: {working}; or re-quantize "
            f"the experts with smaller blocks"
        )


def _tensor_parallel_shards(
    module: nn.Module, params: dict[str, torch.Tensor], world: int, rank: int
) -> dict[str, _Placed]:
    """Rank `rank`'s slice of every expert's intermediate dim, of `params` (the module's
    gate_up/down weights and biases, or a range of experts of them): gate_up column-parallel
    with gate and up paired, down row-parallel (its bias whole, added by rank 0 only)."""
    interleaved = not module.is_concatenated
    transposed = module.is_transposed
    placed = {}
    for pname in (_GATE_UP, _DOWN):
        full = params[pname]
        full_bias = params.get(_BIAS[pname])
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
            if full_bias is not None:
                bias = _compact(torch.cat([full_bias[:, a:b] for a, b in rows], dim=1))
                placed[_BIAS[pname]] = _Placed(
                    bias, (Shard(1) if interleaved else _paired(1),), bias
                )
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
            if full_bias is not None:
                # Row-parallel: the partial sums are all-reduced, so the bias is added by rank 0.
                bias = _compact(full_bias)
                run = bias if rank == 0 else torch.zeros_like(bias)
                placed[_BIAS[pname]] = _Placed(bias, (Replicate(),), run)
        placed[pname] = _Placed(shard, (placement,), shard)
    return placed


def _resize_intermediate(local: nn.Module, world: int, rank: int) -> None:
    for attr in ("intermediate_dim", "intermediate_size"):
        if isinstance(getattr(local, attr, None), int):
            start, end = chunk_bounds(getattr(local, attr), world, rank)
            setattr(local, attr, end - start)


class ExpertTensorParallel(ExpertsStyle):
    """Every expert sliced along its intermediate dim I (see the module docstring): gate_up
    column-parallel with gate and up paired, down row-parallel, one all-reduce."""

    name = "ExpertTensorParallel"

    def check(self, name: str, module: nn.Module, world: int) -> None:
        _check_tensor_parallel(name, module, world, f"qshard.tp.{self.name}")

    def _placed(self, module: nn.Module, world: int, rank: int) -> dict[str, _Placed]:
        params = {name: p.detach() for name, p in module.named_parameters(recurse=False)}
        return _tensor_parallel_shards(module, params, world, rank)

    def _resize(self, module: nn.Module, local: nn.Module, world: int, rank: int) -> None:
        _resize_intermediate(local, world, rank)


def _paired(dim: int) -> Placement:
    """[gate; up] cut into world paired shards: the tensor is first split in two (gate, up),
    then each half is sharded; DTensor's _StridedShard with split_factor 2 says exactly that."""

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
