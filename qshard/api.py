"""`quantize_`: turn a model's nn.Linear weights and expert weights into quantized tensors, in
place, with a report.

A config class maps to a handler, `handler(weight, config) -> QTensor`, registered with
`register_handler`. A handler raises `UnsupportedWeightError` for a weight its layout cannot take;
`quantize_` skips that module and reports why. Any other error stops `quantize_` before it has
changed the model: every weight is quantized first and assigned only when all have succeeded.

Which weights are targets (nn.Linear weights, expert weights) and how include / exclude /
keep_float select them: qshard/targets.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from .config import QuantConfig
from .errors import QShardError, UnsupportedWeightError
from .hooks import run_model_hooks
from .qtensor import QTensor, stored_nbytes
from .qtensor.registry import Handler, handler_for, register_handler
from .shards import is_dtensor, local_tensor
from .targets import (
    KEEP_FLOAT,
    FilterFn,
    Target,
    check_patterns,
    experts_params,
    quantization_targets,
    register_experts,
    skip_reason,
)

__all__ = [
    "KEEP_FLOAT",
    "QuantizationReport",
    "QuantizedModule",
    "SkippedModule",
    "experts_params",
    "quantize_",
    "register_experts",
    "register_handler",
]


@dataclasses.dataclass(frozen=True)
class QuantizedModule:
    name: str
    layout: str
    shape: tuple[int, ...]
    bytes_before: int
    bytes_after: int
    tied_to: str | None = None  # the module whose weight this one shares (counted there)
    # Bytes are this process's: for a sharded (DTensor) weight, the local shard's.


@dataclasses.dataclass(frozen=True)
class SkippedModule:
    name: str
    reason: str


@dataclasses.dataclass
class QuantizationReport:
    """What `quantize_` did: every nn.Linear it saw, quantized or skipped with the reason."""

    config: QuantConfig
    quantized: list[QuantizedModule] = dataclasses.field(default_factory=list)
    skipped: list[SkippedModule] = dataclasses.field(default_factory=list)

    def skipped_names(self) -> set[str]:
        return {s.name for s in self.skipped}

    @property
    def bytes_before(self) -> int:
        return sum(m.bytes_before for m in self.quantized if m.tied_to is None)

    @property
    def bytes_after(self) -> int:
        return sum(m.bytes_after for m in self.quantized if m.tied_to is None)

    def __str__(self) -> str:
        lines = [f"qshard quantization report ({type(self.config).__name__})"]
        for m in self.quantized:
            size = (
                f"tied to {m.tied_to}"
                if m.tied_to
                else (f"{_mib(m.bytes_before)} -> {_mib(m.bytes_after)}")
            )
            lines.append(f"  quantized  {m.name:<32} {m.layout} {list(m.shape)}  {size}")
        for s in self.skipped:
            lines.append(f"  skipped    {s.name:<32} {s.reason}")
        summary = f"  {len(self.quantized)} quantized, {len(self.skipped)} skipped"
        if self.bytes_after:
            ratio = self.bytes_before / self.bytes_after
            summary += (
                f"; weights {_mib(self.bytes_before)} -> {_mib(self.bytes_after)} "
                f"({ratio:.2f}x smaller)"
            )
        lines.append(summary)
        return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def repack_for_device(model: nn.Module) -> nn.Module:
    """Re-make the device form of every quantized weight in `model` (in place; returns it).

    Backends with their own arrangement of the weight (int4 `tinygemm`, `gemlite`) keep it
    beside the canonical packing, for the device the weight is on. `quantize_`, `qshard.load`,
    `qshard.tp.parallelize` and `.to()` make it; call this after changing weights any other way
    (`load_state_dict(assign=True)`, `torch.load`, slicing or sharding by hand). A no-op for the
    other backends."""
    for param in model.parameters():
        local = param._local_tensor if is_dtensor(param) else param
        if isinstance(local, QTensor):
            local.repack_for_device()
    return model


def _quantize_weight(handler: Handler, target: Target, config: QuantConfig) -> torch.Tensor:
    """The handler's QTensor; for a sharded weight (DTensor), each rank quantizes its own shard
    and the result keeps the weight's mesh and placements (shard first, then quantize). A
    transposed expert weight is quantized as [E, N, K] and handed back transposed."""
    weight = target.weight
    if not is_dtensor(weight):
        return quantize_tensor(handler, weight, config, target.transposed)
    from torch.distributed.tensor import DTensor  # start-up time: only for a DTensor weight

    if weight.dim() == 2:
        layout = getattr(handler, "__self__", None)  # a registered layout's from_float
        if isinstance(layout, type) and issubclass(layout, QTensor):
            local = layout.from_float_part(weight.to_local().detach(), weight.detach(), config)
        else:
            local = handler(weight.to_local().detach(), config)
        stride = weight.stride()
    else:
        local = _quantize_local_experts(handler, target, config)
        stride = _outer_stride(weight.shape, target.transposed)
    return DTensor.from_local(
        local,
        weight.device_mesh,
        weight.placements,
        run_check=False,
        shape=weight.shape,
        stride=stride,
    )


def _quantize_local_experts(handler: Handler, target: Target, config: QuantConfig) -> QTensor:
    """This rank's whole experts of a sharded experts weight, quantized here. Sharded by whole
    experts (transformers' ep_plan `grouped_gemm` style is `Shard(0)`) or replicated, a rank
    holds every element of each of its experts, and each expert is quantized on its own
    (docs/design.md invariant 8): the result is the full quantized weight's slice, bit for bit.
    Any other cut (inside each expert's rows or columns) is refused."""
    from torch.distributed.tensor import Replicate, Shard  # start-up time: only for DTensors

    weight = target.weight
    whole = all(
        type(p) is Replicate or (type(p) is Shard and p.dim == 0) for p in weight.placements
    )
    if not whole:
        raise UnsupportedWeightError(
            f"an expert weight sharded inside its experts ({weight.placements}) is quantized "
            f"before sharding in this version: quantize_ first, then shard (qshard.tp's "
            f"ExpertTensorParallel), or shard by whole experts (Shard(0)) and quantize after"
        )
    local = weight.to_local().detach()
    if target.transposed:
        return handler(local.transpose(-2, -1), config).transpose(-2, -1)
    return handler(local, config)


def _outer_stride(shape: torch.Size, transposed: bool) -> tuple[int, ...]:
    """The strides of a QTensor of outer `shape` (a transposed one views [E, N, K] storage)."""
    _, a, b = shape
    return (a * b, 1, a) if transposed else (a * b, b, 1)


def _other_sharers(model: nn.Module, targets: list[Target]) -> dict[int, str]:
    """id(parameter) -> a name of it other than a target's, for target weights that are also
    used elsewhere (an output head tied to the embedding)."""
    owned = {(id(t.module), t.param) for t in targets}
    weights = {id(t.weight) for t in targets}
    sharers: dict[int, str] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in weights and (id(module), param_name) not in owned:
                sharers.setdefault(id(param), f"{module_name}.{param_name}".lstrip("."))
    return sharers


def quantize_(
    model: nn.Module,
    config: QuantConfig,
    filter_fn: FilterFn | None = None,
    include: Sequence[str] | str | None = None,
    exclude: Sequence[str] | str | None = None,
    keep_float: Sequence[str] = KEEP_FLOAT,
) -> QuantizationReport:
    """Quantize the weights of `model`'s nn.Linear modules and the expert weights of its experts
    modules (see the module docstring) in place; return a report.

    include / exclude: fnmatch patterns on full names: a Linear's module name
    (`"model.layers.*.mlp.*"`), an expert weight's `<experts module>.<parameter>`
    (`"*.experts.down_proj"`); a weight must match an include pattern (when given) and no
    exclude pattern. A pattern that matches no name raises ConfigError (nothing changed).
    keep_float: names kept in float unless an include pattern matches them (default
    `KEEP_FLOAT`: embeddings, output heads such as `lm_head`, poolers; the rule
    `qshard quantize` uses); `keep_float=()` quantizes those too. filter_fn(module, name) ->
    bool narrows further. A model given as a bare nn.Linear is quantized under the name "".
    The report lists every weight left in float, with the reason.
    """
    handler = handler_for(config)
    return quantize_with(model, config, handler, filter_fn, include, exclude, keep_float)


def quantize_tensor(
    handler: Handler, weight: torch.Tensor, config: QuantConfig, transposed: bool = False
) -> torch.Tensor:
    """handler(weight, config) for one plain (unsharded) weight; a transposed expert weight
    ([E, K, N]) is quantized as [E, N, K] and handed back transposed."""
    if transposed:
        return handler(weight.detach().transpose(-2, -1), config).transpose(-2, -1)
    return handler(weight.detach(), config)


def quantize_with(
    model: nn.Module,
    config: QuantConfig,
    handler: Handler,
    filter_fn: FilterFn | None = None,
    include: Sequence[str] | str | None = None,
    exclude: Sequence[str] | str | None = None,
    keep_float: Sequence[str] = KEEP_FLOAT,
) -> QuantizationReport:
    """`quantize_` with the weights quantized by `handler(weight, config)` instead of the
    config's registered handler (`qshard.gptq_` passes one that returns its calibrated
    weights): the same selection, tied weights, report, sharded-model agreement, and nothing
    changed unless every selected weight quantized."""
    targets = quantization_targets(model)
    check_patterns([t.name for t in targets], include, exclude)  # the same on every rank
    sharded = [(t.name, t.weight) for t in targets if is_dtensor(t.weight)]  # module order
    try:
        report, pending = _quantize_all(
            model, targets, handler, config, (include, exclude, filter_fn, keep_float)
        )
    except QShardError:
        _agree_across_ranks(sharded, failed=True, skipped=set())  # the other ranks raise too
        raise
    if sharded:
        skipped = _agree_across_ranks(sharded, failed=False, skipped=report.skipped_names())
        report, pending = _skip_everywhere(report, pending, skipped)
    # Assign only now: an error above leaves the model as it was.
    for target, param in pending:
        setattr(target.module, target.param, param)
    if pending:
        run_model_hooks(model)  # transformers: save_pretrained then writes qshard's format
    return report


Pending = list[tuple[Target, nn.Parameter]]


def _quantize_all(model, targets, handler, config, selection):
    """(report, [(target, quantized Parameter)]) without changing the model."""
    include, exclude, filter_fn, keep_float = selection
    report = QuantizationReport(config)
    pending: Pending = []
    # A weight shared by several modules stays shared: id(float weight) -> (first target's
    # name, its quantized Parameter, or None when that one was skipped).
    done: dict[int, tuple[str, nn.Parameter | None]] = {}
    foreign = _other_sharers(model, targets)
    for target in targets:
        name, weight = target.name, target.weight
        first = done.get(id(weight))
        if first is not None and first[1] is None:
            report.skipped.append(SkippedModule(name, f"its weight is tied to {first[0]!r}"))
            continue
        if first is not None:
            pending.append((target, first[1]))
            layout = type(local_tensor(first[1])).__name__
            report.quantized.append(
                QuantizedModule(name, layout, tuple(weight.shape), 0, 0, first[0])
            )
            continue
        reason = skip_reason(target, include, exclude, filter_fn, keep_float)
        if reason is None and id(weight) in foreign:
            reason = (
                f"its weight is tied to {foreign[id(weight)]} (not a quantized weight); "
                f"untie it or exclude this module"
            )
        if reason is None:
            try:
                qweight = _quantize_weight(handler, target, config)
            except UnsupportedWeightError as e:
                reason = str(e)
            except QShardError as e:
                raise type(e)(f"quantize_: module {name!r}{_shard_text(weight)}: {e}") from e
        if reason is not None:
            done[id(weight)] = (name, None)
            report.skipped.append(SkippedModule(name, reason))
            continue
        param = nn.Parameter(qweight, requires_grad=False)
        done[id(weight)] = (name, param)
        pending.append((target, param))
        report.quantized.append(
            QuantizedModule(
                name,
                type(local_tensor(qweight)).__name__,
                tuple(weight.shape),
                stored_nbytes(local_tensor(weight)),
                stored_nbytes(local_tensor(qweight)),
            )
        )
    return report, pending


# ---- sharded models: every rank quantizes its own shard, and all must agree -----------------


def _shard_text(weight: torch.Tensor) -> str:
    if not is_dtensor(weight):
        return ""
    local = list(weight.to_local().shape)
    return f" (this rank's shard {local} of the {list(weight.shape)} weight)"


def _agree_across_ranks(
    sharded: list[tuple[str, torch.Tensor]], failed: bool, skipped: set[str]
) -> set[str]:
    """Tell every rank of each mesh whether one failed, and which sharded modules any rank
    skipped (its shard could not be quantized there); returns those names. Raises if another
    rank failed. One all_reduce per device mesh."""
    if not sharded:
        return set()
    names = [name for name, _ in sharded]
    flags = [float(failed)] + [float(n in skipped) for n in names]
    meshes = {id(w.device_mesh): w.device_mesh for _, w in sharded}
    for mesh in meshes.values():
        device = torch.cuda.current_device() if mesh.device_type == "cuda" else "cpu"
        votes = torch.tensor(flags, device=device)
        torch.distributed.all_reduce(votes, torch.distributed.ReduceOp.MAX, mesh.get_group())
        flags = votes.tolist()
    if flags[0] and not failed:
        raise QShardError(
            "quantize_: another rank failed to quantize its shard (its error says why); nothing "
            "was changed on this rank"
        )
    return {name for name, flag in zip(names, flags[1:], strict=True) if flag}


def _skip_everywhere(
    report: QuantizationReport, pending: Pending, skipped: set[str]
) -> tuple[QuantizationReport, Pending]:
    """Skip on this rank too what another rank had to skip, so every rank keeps one layout."""
    elsewhere = {m.name for m in report.quantized} & skipped
    if not elsewhere:
        return report, pending
    report.quantized = [m for m in report.quantized if m.name not in elsewhere]
    report.skipped += [
        SkippedModule(name, "another rank could not quantize its shard of this weight")
        for name in sorted(elsewhere)
    ]
    return report, [p for p in pending if p[0].name not in elsewhere]
