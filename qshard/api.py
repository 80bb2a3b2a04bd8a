"""`quantize_`: turn a model's nn.Linear weights into quantized tensors, in place, with a report.

A config class maps to a handler, `handler(weight, config) -> QTensor`, registered with
`register_handler`. A handler raises `UnsupportedWeightError` for a weight its layout cannot take;
`quantize_` skips that module and reports why. Any other error stops `quantize_` before it has
changed the model: every weight is quantized first and assigned only when all have succeeded.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Sequence

import torch
from torch import nn

from .config import QuantConfig
from .errors import ConfigError, QShardError, UnsupportedWeightError
from .qtensor import QTensor, stored_nbytes

__all__ = [
    "QuantizationReport",
    "QuantizedModule",
    "SkippedModule",
    "quantize_",
    "register_handler",
]

Handler = Callable[[torch.Tensor, QuantConfig], QTensor]
FilterFn = Callable[[nn.Module, str], bool]

_HANDLERS: dict[type[QuantConfig], Handler] = {}


def register_handler(config_cls: type[QuantConfig], handler: Handler | None = None):
    """Register `handler(weight, config) -> QTensor` for `config_cls` (usable as a decorator)."""

    def decorator(fn: Handler) -> Handler:
        _HANDLERS[config_cls] = fn
        return fn

    return decorator(handler) if handler is not None else decorator


@dataclasses.dataclass(frozen=True)
class QuantizedModule:
    name: str
    layout: str
    shape: tuple[int, int]
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


def _skip_reason(
    name: str,
    module: nn.Linear,
    include: Sequence[str] | str | None,
    exclude: Sequence[str] | str | None,
    filter_fn: FilterFn | None,
) -> str | None:
    include = [include] if isinstance(include, str) else include
    exclude = [exclude] if isinstance(exclude, str) else exclude
    if include is not None and not any(fnmatch.fnmatchcase(name, p) for p in include):
        return f"matches no include pattern {list(include)}"
    for pattern in exclude or ():
        if fnmatch.fnmatchcase(name, pattern):
            return f"excluded by pattern {pattern!r}"
    if filter_fn is not None and not filter_fn(module, name):
        return "filter_fn returned False"
    if isinstance(module.weight, nn.parameter.UninitializedParameter):
        return "its weight is not initialized yet (lazy module); run a forward pass first"
    local = _local(module.weight)
    if isinstance(local, QTensor):
        return f"already quantized ({type(local).__name__})"
    return None


def repack_for_device(model: nn.Module) -> nn.Module:
    """Re-make the device form of every quantized weight in `model` (in place; returns it).

    Backends with their own arrangement of the weight (int4 `tinygemm`, `gemlite`) keep it
    beside the canonical packing, for the device the weight is on. `quantize_`, `qshard.load`,
    `qshard.tp.parallelize` and `.to()` make it; call this after changing weights any other way
    (`load_state_dict(assign=True)`, `torch.load`, slicing or sharding by hand). A no-op for the
    other backends."""
    for param in model.parameters():
        local = param._local_tensor if _is_dtensor(param) else param
        if isinstance(local, QTensor):
            local.repack_for_device()
    return model


def _is_dtensor(t: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; any other tensor itself."""
    return t.to_local() if _is_dtensor(t) else t


def _quantize_weight(handler: Handler, weight: torch.Tensor, config: QuantConfig) -> torch.Tensor:
    """The handler's QTensor; for a sharded weight (DTensor), each rank quantizes its own shard
    and the result keeps the weight's mesh and placements (shard first, then quantize)."""
    if not _is_dtensor(weight):
        return handler(weight.detach(), config)
    from torch.distributed.tensor import DTensor

    layout = getattr(handler, "__self__", None)  # a registered layout's from_float
    if isinstance(layout, type) and issubclass(layout, QTensor):
        local = layout.from_float_part(weight.to_local().detach(), weight.detach(), config)
    else:
        local = handler(weight.to_local().detach(), config)
    return DTensor.from_local(
        local,
        weight.device_mesh,
        weight.placements,
        run_check=False,
        shape=weight.shape,
        stride=weight.stride(),
    )


def _non_linear_sharers(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> a name of it outside any nn.Linear's weight, for Linear weights that are
    also used elsewhere (an output head tied to the embedding)."""
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    sharers: dict[int, str] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for param_name, param in module.named_parameters(recurse=False):
            is_linear_weight = isinstance(module, nn.Linear) and param_name == "weight"
            if id(param) in linear_weights and not is_linear_weight:
                sharers.setdefault(id(param), f"{module_name}.{param_name}".lstrip("."))
    return sharers


def quantize_(
    model: nn.Module,
    config: QuantConfig,
    filter_fn: FilterFn | None = None,
    include: Sequence[str] | str | None = None,
    exclude: Sequence[str] | str | None = None,
) -> QuantizationReport:
    """Quantize the weights of `model`'s nn.Linear modules in place; return a report.

    include / exclude: fnmatch patterns on module names (`"layers.*.mlp.*"`); a module must match
    an include pattern (when given) and no exclude pattern. filter_fn(module, name) -> bool
    narrows further. A model given as a bare nn.Linear is quantized under the name "".
    """
    if isinstance(config, type):
        raise ConfigError(
            f"quantize_: got the class {config.__name__}, not a config; pass an instance, "
            f"e.g. {config.__name__}()"
        )
    handler = _HANDLERS.get(type(config))
    if handler is None:
        known = ", ".join(sorted(c.__name__ for c in _HANDLERS))
        raise ConfigError(
            f"quantize_: no handler for {type(config).__name__}; registered configs: {known}. "
            f"Register one with qshard.register_handler({type(config).__name__}, fn)"
        )
    return quantize_with(model, config, handler, filter_fn, include, exclude)


def quantize_with(
    model: nn.Module,
    config: QuantConfig,
    handler: Handler,
    filter_fn: FilterFn | None = None,
    include: Sequence[str] | str | None = None,
    exclude: Sequence[str] | str | None = None,
) -> QuantizationReport:
    """`quantize_` with the weights quantized by `handler(weight, config)` instead of the
    config's registered handler (`qshard.gptq_` passes one that returns its calibrated
    weights): the same selection, tied weights, report, sharded-model agreement, and nothing
    changed unless every selected weight quantized."""
    sharded = _sharded_linears(model)
    try:
        report, pending = _quantize_all(model, handler, config, include, exclude, filter_fn)
    except QShardError:
        _agree_across_ranks(sharded, failed=True, skipped=set())  # the other ranks raise too
        raise
    if sharded:
        skipped = _agree_across_ranks(sharded, failed=False, skipped=report.skipped_names())
        report, pending = _skip_everywhere(report, pending, skipped)
    # Assign only now: an error above leaves the model as it was.
    for _, module, param in pending:
        module.weight = param
    return report


Pending = list[tuple[str, nn.Linear, nn.Parameter]]


def _quantize_all(model, handler, config, include, exclude, filter_fn):
    """(report, [(name, module, quantized Parameter)]) without changing the model."""
    report = QuantizationReport(config)
    pending: Pending = []
    # A weight shared by several modules stays shared: id(float weight) -> (first module's
    # name, its quantized Parameter, or None when that module was skipped).
    done: dict[int, tuple[str, nn.Parameter | None]] = {}
    foreign = _non_linear_sharers(model)
    for name, module in model.named_modules(remove_duplicate=False):
        if not isinstance(module, nn.Linear):
            continue
        first = done.get(id(module.weight))
        if first is not None and first[1] is None:
            report.skipped.append(SkippedModule(name, f"its weight is tied to {first[0]!r}"))
            continue
        if first is not None:
            pending.append((name, module, first[1]))
            layout = type(_local(first[1])).__name__
            shape = tuple(module.weight.shape)
            report.quantized.append(QuantizedModule(name, layout, shape, 0, 0, first[0]))
            continue
        reason = _skip_reason(name, module, include, exclude, filter_fn)
        if reason is None and id(module.weight) in foreign:
            reason = (
                f"its weight is tied to {foreign[id(module.weight)]} (not a Linear weight); "
                f"untie it or exclude this module"
            )
        if reason is None:
            try:
                qweight = _quantize_weight(handler, module.weight, config)
            except UnsupportedWeightError as e:
                reason = str(e)
            except QShardError as e:
                raise type(e)(f"quantize_: module {name!r}{_shard_text(module.weight)}: {e}") from e
        if reason is not None:
            done[id(module.weight)] = (name, None)
            report.skipped.append(SkippedModule(name, reason))
            continue
        param = nn.Parameter(qweight, requires_grad=False)
        done[id(module.weight)] = (name, param)
        pending.append((name, module, param))
        report.quantized.append(
            QuantizedModule(
                name,
                type(_local(qweight)).__name__,
                tuple(module.weight.shape),
                stored_nbytes(_local(module.weight)),
                stored_nbytes(_local(qweight)),
            )
        )
    return report, pending


# ---- sharded models: every rank quantizes its own shard, and all must agree -----------------


def _sharded_linears(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, weight) of every nn.Linear whose weight is a DTensor, in module order (the same
    on every rank)."""
    return [
        (name, m.weight)
        for name, m in model.named_modules(remove_duplicate=False)
        if isinstance(m, nn.Linear) and _is_dtensor(m.weight)
    ]


def _shard_text(weight: torch.Tensor) -> str:
    if not _is_dtensor(weight):
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
    return report, [p for p in pending if p[0] not in elsewhere]
