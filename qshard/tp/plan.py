"""`parallelize(model, mesh, plan)`: apply a tensor-parallel plan table to a (quantized) model.

A plan maps fnmatch patterns on module names to styles, the torchtitan way:

    plan = {"layers.*.attn.qkv": "colwise", "layers.*.attn.o": "rowwise", ...}

A style is a `ParallelStyle` (qshard's, or torch's `ColwiseParallel()` / `RowwiseParallel()`,
which are converted to their quantization-aware versions with the same input/output layouts) or
the string "colwise" / "rowwise". Every sharded quantized weight is checked against its layout's
blocks for the mesh size before anything changes; a plan that cannot be applied raises
QShardError listing the tensor-parallel sizes that would work.

Order of transforms: quantize_ -> parallelize -> torch.compile (quantize first so each rank
slices the quantized weight; `quantize_` on an already sharded model quantizes each local shard).
"""

from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ..errors import MisalignedSliceError, QShardError
from ..qtensor import QTensor
from ..shards import is_dtensor
from .experts import ExpertParallel, ExpertsStyle, ExpertTensorParallel
from .styles import QuantColwiseParallel, QuantRowwiseParallel, param_placements, shard_cuts

__all__ = [
    "CANDIDATE_TP_SIZES",
    "apply_styles",
    "checked_placements",
    "parallelize",
    "resolve_plan",
]

CANDIDATE_TP_SIZES = tuple(range(1, 65))  # what an error lists as sizes that work
_STYLE_NAMES = {
    "colwise": QuantColwiseParallel,
    "rowwise": QuantRowwiseParallel,
    "expert_parallel": ExpertParallel,
    "expert_tensor_parallel": ExpertTensorParallel,
}


def _quant_aware(style: ParallelStyle | str, pattern: str) -> ParallelStyle:
    if isinstance(style, str):
        if style not in _STYLE_NAMES:
            raise QShardError(
                f"qshard.tp plan: style {style!r} for {pattern!r} is not one of "
                f"{list(_STYLE_NAMES)}; or pass a ParallelStyle instance"
            )
        return _STYLE_NAMES[style]()
    for stock, quant in (
        (ColwiseParallel, QuantColwiseParallel),
        (RowwiseParallel, QuantRowwiseParallel),
    ):
        if type(style) is stock:  # same input/output layouts, quantization-aware sharding
            converted = quant.__new__(quant)
            converted.__dict__.update(style.__dict__)
            return converted
    if not isinstance(style, ParallelStyle):
        raise QShardError(
            f"qshard.tp plan: {style!r} for {pattern!r} is not a ParallelStyle or a style name"
        )
    return style


Plan = Mapping[str, ParallelStyle | str] | ParallelStyle | str


def _matches(name: str, pattern: str) -> bool:
    """torch's parallelize_module rule: one fnmatch per dotted segment ("layers.*" matches
    "layers.0", not "layers.0.attn")."""
    names, patterns = name.split("."), pattern.split(".")
    return len(names) == len(patterns) and all(
        fnmatch.fnmatchcase(n, p) for n, p in zip(names, patterns, strict=True)
    )


def resolve_plan(model: nn.Module, plan: Plan) -> dict[str, ParallelStyle]:
    """{module name: style} for every module a pattern matches. A single style (not a table),
    or the key "", applies to `model` itself. A module matched by two entries is an error."""
    if not isinstance(plan, Mapping):
        plan = {"": plan}
    names = [name for name, _ in model.named_modules()]
    resolved: dict[str, ParallelStyle] = {}
    source: dict[str, str] = {}
    for pattern, style in plan.items():
        matches = [n for n in names if n == pattern or (n and pattern and _matches(n, pattern))]
        if not matches:
            raise QShardError(
                f"qshard.tp plan: {pattern!r} matches no module of {type(model).__name__} (a "
                f"'*' matches one dotted segment); module names look like {names[1:5]}"
            )
        converted = _quant_aware(style, pattern or "the model")
        for name in matches:
            if name in resolved:
                raise QShardError(
                    f"qshard.tp plan: module {name!r} is matched by both {source[name]!r} and "
                    f"{pattern!r}; give each module one style"
                )
            resolved[name], source[name] = converted, pattern
    return resolved


# Styles that distribute a module's parameters themselves (broadcast or scatter), which a
# quantized tensor cannot go through; the hook-only styles (PrepareModuleInput, ...) can.
_PARAMETER_STYLES = (ColwiseParallel, RowwiseParallel, SequenceParallel)


def _check_entry(name: str, module: nn.Module, style: ParallelStyle) -> None:
    if isinstance(style, ColwiseParallel | RowwiseParallel) and not isinstance(
        module, nn.Linear | nn.Embedding
    ):
        raise QShardError(
            f"qshard.tp plan: {name!r} is a {type(module).__name__}; {type(style).__name__} "
            f"shards nn.Linear and nn.Embedding (point the entry at the Linear inside it)"
        )
    if any(is_dtensor(p) for p in module.parameters(recurse=False)):
        raise QShardError(f"qshard.tp plan: {name!r} is already sharded; parallelize once")
    quantized = any(isinstance(p, QTensor) for p in module.parameters(recurse=False))
    quant_aware = isinstance(style, QuantColwiseParallel | QuantRowwiseParallel)
    if quantized and isinstance(style, _PARAMETER_STYLES) and not quant_aware:
        raise QShardError(
            f"qshard.tp plan: {name!r} has a quantized weight and style "
            f"{type(style).__name__}, which would send it through a collective; use "
            f"'colwise' or 'rowwise'"
        )


def _sharded_weights(model: nn.Module, resolved: Mapping[str, ParallelStyle]):
    """(module name, quantized weight, sharded logical dim) for every quantized Linear the plan
    shards."""
    for name, style in resolved.items():
        module = model.get_submodule(name)
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Linear) and isinstance(weight, QTensor):
            if isinstance(style, QuantColwiseParallel):
                yield name, weight, 0
            elif isinstance(style, QuantRowwiseParallel):
                yield name, weight, 1


def _fits(weight: QTensor, dim: int, world: int) -> bool:
    try:
        weight.realign(dim, shard_cuts(weight.logical_shape[dim], world))
    except MisalignedSliceError:
        return False
    return True


def _check_alignment(sharded: list[tuple[str, QTensor, int]], world: int) -> None:
    """Every sharded quantized weight can be cut at the `world`-way shard boundaries."""
    failures = []
    for name, weight, dim in sharded:
        try:
            weight.realign(dim, shard_cuts(weight.logical_shape[dim], world))
        except MisalignedSliceError as e:
            failures.append(f"{name!r}: {e}")
    if failures:
        working = [tp for tp in CANDIDATE_TP_SIZES if all(_fits(w, d, tp) for _, w, d in sharded)]
        raise QShardError(
            f"qshard.tp: tensor-parallel size {world} cuts quantized blocks: "
            + "; ".join(failures)
            + f". Tensor-parallel sizes that work for this model: {working}; or re-quantize "
            f"with smaller blocks"
        )


def _validate(model: nn.Module, resolved: Mapping[str, ParallelStyle], world: int) -> None:
    """Everything that can be checked before the model changes."""
    for name, style in resolved.items():
        _check_entry(name, model.get_submodule(name), style)
        if isinstance(style, ExpertsStyle):  # experts modules: their own shard rules
            style.check(name, model.get_submodule(name), world)
    _check_alignment(list(_sharded_weights(model, resolved)), world)


def _check_mesh(mesh: DeviceMesh, caller: str) -> None:
    if mesh.ndim != 1:
        raise QShardError(
            f"{caller}: a {mesh.ndim}-D device mesh; tensor parallelism takes a 1-D mesh (pass "
            f"the TP sub-mesh, e.g. mesh['tp'])"
        )


def checked_placements(
    model: nn.Module, mesh: DeviceMesh, plan: Plan, tensors: Mapping[str, torch.Tensor]
) -> tuple[dict[str, ParallelStyle], dict[str, Placement]]:
    """For a sharded load: the resolved plan and {state_dict key: placement} of every parameter
    it places, checked as `parallelize` checks (with the checkpoint's `tensors`, on the meta
    device, standing in for the model's) before anything is read or changed."""
    _check_mesh(mesh, "qshard.load")
    resolved = resolve_plan(model, plan)
    placements: dict[str, Placement] = {}
    sharded = []
    for name, style in resolved.items():
        module = model.get_submodule(name)
        _check_entry(name, module, style)
        if isinstance(style, ExpertsStyle):
            style.check(name, module, mesh.size())
            style.check_mesh(mesh)
        for param, placement in param_placements(style, module).items():
            key = f"{name}.{param}" if name else param
            placements[key] = placement
            tensor = tensors.get(key)
            if isinstance(tensor, QTensor) and isinstance(placement, Shard):
                sharded.append((key, tensor, tensor.logical_dim(placement.dim)))
    _check_alignment(sharded, mesh.size())
    return resolved, placements


# The style each module was sharded with, for `to_local` (weak: a module's entry goes with it).
APPLIED_STYLES: weakref.WeakKeyDictionary[nn.Module, ParallelStyle] = weakref.WeakKeyDictionary()


def apply_styles(
    model: nn.Module, mesh: DeviceMesh, resolved: Mapping[str, ParallelStyle], loaded=False
):
    """Run the resolved styles (torch's parallelize_module): parameters that are DTensors
    already are kept, the input/output hooks are installed. `loaded`: after a sharded
    qshard.load, whose DTensors the experts styles take as their shards."""
    for name, style in resolved.items():
        APPLIED_STYLES[model.get_submodule(name)] = style
    resolved = dict(resolved)
    if loaded:
        for name in [n for n, style in resolved.items() if isinstance(style, ExpertsStyle)]:
            resolved.pop(name)._apply(model.get_submodule(name), mesh, loaded=True)
    root = resolved.pop("", None)
    if root is not None:
        parallelize_module(model, mesh, root)
    if resolved:
        parallelize_module(model, mesh, resolved)


def parallelize(model: nn.Module, mesh: DeviceMesh, plan: Plan) -> nn.Module:
    """Shard `model` in place over the 1-D `mesh` by `plan` (a table of module-name patterns to
    styles, or one style for `model` itself); returns the model. Every entry is checked before
    anything changes."""
    _check_mesh(mesh, "qshard.tp.parallelize")
    resolved = resolve_plan(model, plan)
    _validate(model, resolved, mesh.size())
    for style in resolved.values():
        if isinstance(style, ExpertsStyle):  # e.g. EP x TP makes its 2-D mesh here
            style.check_mesh(mesh)
    apply_styles(model, mesh, resolved)
    return model
