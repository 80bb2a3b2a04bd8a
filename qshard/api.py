"""`quantize_`: turn a model's nn.Linear weights and expert weights into quantized tensors, in
place, with a report.

A config class maps to a handler, `handler(weight, config) -> QTensor`, registered with
`register_handler`. A handler raises `UnsupportedWeightError` for a weight its layout cannot take;
`quantize_` skips that module and reports why. Any other error stops `quantize_` before it has
changed the model: every weight is quantized first and assigned only when all have succeeded.

Expert weights are the 3-D parameters [E, N, K] of an experts module (design.md §5):
transformers' experts classes are recognised by what their `use_experts_implementation`
decorator sets on them (`is_transposed`, `has_bias`, ...; not by name), other classes by
`register_experts`. Each such parameter is quantized as a whole (`from_float` quantizes each
expert as its own [N, K] weight); a transposed one ([E, K, N], gpt-oss) is quantized along its
contraction dim K and keeps its outer shape (`transpose(-2, -1)` of the [E, N, K] tensor). A
router stays float: it is not an experts module's 3-D parameter.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import sys
from collections.abc import Callable, Sequence

import torch
from torch import nn

from .config import QuantConfig
from .errors import ConfigError, QShardError, UnsupportedWeightError
from .qtensor import QTensor, stored_nbytes

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
class ExpertsSpec:
    """How an experts module holds its weights: the names of its 3-D [E, N, K] parameters
    (None: every 3-D floating-point parameter it holds directly), and whether they are stored
    transposed, [E, K, N] (in_features x out_features per expert)."""

    params: tuple[str, ...] | None = None
    transposed: bool = False


_EXPERTS: dict[type[nn.Module], ExpertsSpec] = {}


def register_experts(
    module_cls: type[nn.Module], params: Sequence[str] | None = None, transposed: bool = False
) -> type[nn.Module]:
    """Make `quantize_` (and `gptq_`) quantize the 3-D expert weights of `module_cls` modules.

    params: the names of its [E, N, K] parameters (default: every 3-D floating-point parameter
    the module holds directly). transposed: True when they are stored [E, K, N]. The module's
    forward must multiply them with `torch._grouped_mm`/`F.grouped_mm`, `torch.bmm`, or
    `F.linear(x, w[e])` (see qshard/qtensor/grouped.py). transformers' experts classes need no
    registration. Usable as a class decorator; returns the class."""
    if not (isinstance(module_cls, type) and issubclass(module_cls, nn.Module)):
        raise ConfigError(f"register_experts: {module_cls!r} is not an nn.Module class")
    names = params is None or (
        not isinstance(params, str) and all(isinstance(p, str) for p in params)
    )
    if not names:
        raise ConfigError(f"register_experts: params={params!r} must be a list of names")
    if not isinstance(transposed, bool):
        raise ConfigError(f"register_experts: transposed={transposed!r} must be True or False")
    _EXPERTS[module_cls] = ExpertsSpec(None if params is None else tuple(params), transposed)
    return module_cls


def experts_params(module: nn.Module) -> list[tuple[str, bool]] | None:
    """[(parameter name, stored transposed)] of an experts module's 3-D expert weights, or None
    for a module that is not an experts module (see the module docstring)."""
    spec = next((s for c, s in _EXPERTS.items() if isinstance(module, c)), None)
    if spec is None and _is_transformers_experts(module):
        spec = ExpertsSpec(None, module.is_transposed)
    if spec is None:
        return None
    own = dict(module.named_parameters(recurse=False))
    if spec.params is not None:
        missing = [n for n in spec.params if n not in own]
        if missing:
            raise ConfigError(
                f"{type(module).__name__} is registered as experts with parameters "
                f"{list(spec.params)}, but it has no {missing} (it has {sorted(own)})"
            )
        return [(n, spec.transposed) for n in spec.params]
    return [
        (n, spec.transposed) for n, p in own.items() if p.dim() == 3 and p.dtype.is_floating_point
    ]


def _is_transformers_experts(module: nn.Module) -> bool:
    """What transformers' `use_experts_implementation` sets on every instance it decorates."""
    marks = ("is_transposed", "has_bias", "is_concatenated")
    return all(isinstance(getattr(module, m, None), bool) for m in marks)


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


@dataclasses.dataclass(frozen=True)
class Target:
    """A weight `quantize_` may quantize: `module.<param>`, reported (and matched by include /
    exclude) under `name`: a Linear's module name, or `<experts module>.<param>`."""

    name: str
    module: nn.Module
    param: str
    transposed: bool = False  # stored [E, K, N]: quantized along its contraction dim

    @property
    def weight(self) -> torch.Tensor:
        return getattr(self.module, self.param)


def quantization_targets(model: nn.Module) -> list[Target]:
    """Every nn.Linear weight and expert weight of `model`, in module order."""
    targets = []
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, nn.Linear):
            targets.append(Target(name, module, "weight"))
            continue
        for param, transposed in experts_params(module) or ():
            targets.append(Target(f"{name}.{param}".lstrip("."), module, param, transposed))
    return targets


# Weights kept in float unless asked, by module name (fnmatch): embeddings (for `qshard quantize`,
# which sees every 2-D tensor; embedding-like input projections), output heads (transformers'
# `lm_head`, GPT-NeoX's `embed_out`, gpt-fast's top-level `output`: the head as a whole name
# component, so that `lm_head_proj` or `output_proj` are not caught) and poolers, as the
# checkpoints of facts.md §5 leave them. No norm patterns: norms are no linear targets, and a
# name such as diffusers' `norm1.linear` or `layernorm_proj` is a real projection. One rule for
# `quantize_`, `gptq_` and `qshard quantize` (qshard/convert.py).
KEEP_FLOAT = ("*embed*", "lm_head", "*.lm_head", "output", "*pooler*")


def _patterns(patterns: Sequence[str] | str | None) -> list[str] | None:
    return [patterns] if isinstance(patterns, str) else None if patterns is None else list(patterns)


def _skip_reason(
    target: Target,
    include: Sequence[str] | str | None,
    exclude: Sequence[str] | str | None,
    filter_fn: FilterFn | None,
    keep_float: Sequence[str] = KEEP_FLOAT,
) -> str | None:
    name = target.name
    include, exclude = _patterns(include), _patterns(exclude)
    if include is not None and not any(fnmatch.fnmatchcase(name, p) for p in include):
        return f"matches no include pattern {include}"
    for pattern in exclude or ():
        if fnmatch.fnmatchcase(name, pattern):
            return f"excluded by pattern {pattern!r}"
    kept = next((p for p in _patterns(keep_float) if fnmatch.fnmatchcase(name, p)), None)
    if kept is not None and include is None:  # an include pattern that matches it asks for it
        return (
            f"kept in float: embeddings, output heads and poolers are, by default "
            f"(keep_float pattern {kept!r}); to quantize it pass include=[{name!r}, ...] or "
            f"keep_float=()"
        )
    if filter_fn is not None and not filter_fn(target.module, name):
        return "filter_fn returned False"
    if isinstance(target.weight, nn.parameter.UninitializedParameter):
        return "its weight is not initialized yet (lazy module); run a forward pass first"
    local = _local(target.weight)
    if isinstance(local, QTensor):
        return f"already quantized ({type(local).__name__})"
    return None


def selected_targets(
    model: nn.Module,
    exclude: Sequence[str] | str | None = None,
    keep_float: Sequence[str] = KEEP_FLOAT,
    caller: str = "quantize_",
    prefix: str = "",
) -> list[Target]:
    """The weights `quantize_(model, config, exclude=exclude, keep_float=keep_float)` would
    quantize (an `exclude` pattern that matches nothing: ConfigError, as there; `caller` and
    `prefix` as check_patterns')."""
    targets = quantization_targets(model)
    check_patterns([t.name for t in targets], None, exclude, caller, prefix)
    return [t for t in targets if _skip_reason(t, None, exclude, None, keep_float) is None]


def check_patterns(
    names: Sequence[str],
    include: Sequence[str] | str | None,
    exclude: Sequence[str] | str | None,
    caller: str = "quantize_",
    prefix: str = "",
) -> None:
    """Raise ConfigError for an include or exclude pattern that matches none of `names` (the
    weights' names): a typo would otherwise quantize everything, or nothing, silently. `prefix`
    goes before the option's name in the message (the CLI's "--")."""
    names = list(dict.fromkeys(names))
    for kind, patterns in (("include", _patterns(include)), ("exclude", _patterns(exclude))):
        kind = prefix + kind
        for pattern in patterns or ():
            if not isinstance(pattern, str):
                raise ConfigError(f"{caller}: {kind} pattern {pattern!r} is not a string; pass "
                                  f"fnmatch patterns such as '*.mlp.*'")  # fmt: skip
            if any(fnmatch.fnmatchcase(n, pattern) for n in names):
                continue
            if not names:
                raise ConfigError(f"{caller}: {kind} pattern {pattern!r} matches nothing: the "
                                  f"model has no nn.Linear or expert weight")  # fmt: skip
            raise ConfigError(
                f"{caller}: {kind} pattern {pattern!r} matches no weight of this model "
                f"(fnmatch on full names), so it would select nothing; its names are like "
                f"{_some_names(pattern, names)} ({len(names)} in all){_hint(pattern, names)}. "
                f"Nothing was changed"
            )


def _some_names(pattern: str, names: list[str]) -> list[str]:
    """A few real names: those closest to `pattern` first, then the first ones."""
    close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.3)
    return list(dict.fromkeys([*close, *names]))[:4]


def _hint(pattern: str, names: list[str]) -> str:
    for fix in (f"*{pattern}", f"*.{pattern}", f"*{pattern}*"):  # HF names start with `model.`
        if any(fnmatch.fnmatchcase(n, fix) for n in names):
            return f"; did you mean {fix!r}?"
    return ""


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
    # No DTensor exists before torch.distributed.tensor is imported: no need to import it here
    # (a third of a second) to know that.
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; any other tensor itself."""
    return t.to_local() if _is_dtensor(t) else t


def _quantize_weight(handler: Handler, target: Target, config: QuantConfig) -> torch.Tensor:
    """The handler's QTensor; for a sharded weight (DTensor), each rank quantizes its own shard
    and the result keeps the weight's mesh and placements (shard first, then quantize). A
    transposed expert weight is quantized as [E, N, K] and handed back transposed."""
    weight = target.weight
    if not _is_dtensor(weight):
        return quantize_tensor(handler, weight, config, target.transposed)
    from torch.distributed.tensor import DTensor

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
    (design.md invariant 8): the result is the full quantized weight's slice, bit for bit.
    Any other cut (inside each expert's rows or columns) is refused."""
    from torch.distributed.tensor import Replicate, Shard

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


def handler_for(config: QuantConfig, caller: str = "quantize_") -> Handler:
    """The handler registered for `config`'s class; ConfigError for a class or an unknown config."""
    if isinstance(config, type):
        raise ConfigError(
            f"{caller}: got the class {config.__name__}, not a config; pass an instance, "
            f"e.g. {config.__name__}()"
        )
    handler = _HANDLERS.get(type(config))
    if handler is None:
        known = ", ".join(sorted(c.__name__ for c in _HANDLERS))
        raise ConfigError(
            f"{caller}: no handler for {type(config).__name__}; registered configs: {known}. "
            f"Register one with qshard.register_handler({type(config).__name__}, fn)"
        )
    return handler


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
    sharded = [(t.name, t.weight) for t in targets if _is_dtensor(t.weight)]  # module order
    try:
        report, pending = _quantize_all(model, targets, handler, config,
                                        (include, exclude, filter_fn, keep_float))  # fmt: skip
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
        attach_to_transformers(model)
    return report


def attach_to_transformers(model: nn.Module) -> None:
    """If `model` is a transformers model holding qshard weights (quantize_, qshard.load),
    attach qshard's quantizer as from_pretrained would, so that save_pretrained writes qshard's
    format (integrations/transformers.py)."""
    hf = sys.modules.get("transformers.modeling_utils")
    if hf is not None and isinstance(model, hf.PreTrainedModel):
        try:
            from .integrations.transformers import attach
        except ImportError as e:  # an unsupported transformers: the model is quantized anyway
            import warnings

            warnings.warn(f"qshard: save_pretrained will not write this model ({e})",
                          stacklevel=3)  # fmt: skip
            return
        attach(model)


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
            layout = type(_local(first[1])).__name__
            report.quantized.append(
                QuantizedModule(name, layout, tuple(weight.shape), 0, 0, first[0])
            )
            continue
        reason = _skip_reason(target, include, exclude, filter_fn, keep_float)
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
                type(_local(qweight)).__name__,
                tuple(weight.shape),
                stored_nbytes(_local(weight)),
                stored_nbytes(_local(qweight)),
            )
        )
    return report, pending


# ---- sharded models: every rank quantizes its own shard, and all must agree -----------------


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
    return report, [p for p in pending if p[0].name not in elsewhere]
