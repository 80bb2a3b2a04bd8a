"""Which weights of a model are quantization targets: every nn.Linear weight and every expert
weight, selected by include / exclude / keep_float patterns. One rule for `quantize_`, `gptq_`,
`qshard quantize` and transformers' `from_pretrained`.

Expert weights are the 3-D parameters [E, N, K] of an experts module (docs/design.md, "Experts in
transformers"):
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
from collections.abc import Callable, Sequence

import torch
from torch import nn

from .errors import ConfigError
from .qtensor import QTensor
from .shards import local_tensor

__all__ = [
    "KEEP_FLOAT",
    "ExpertsSpec",
    "Target",
    "check_patterns",
    "experts_params",
    "is_transformers_experts",
    "quantization_targets",
    "register_experts",
    "selected_targets",
    "skip_reason",
]

FilterFn = Callable[[nn.Module, str], bool]


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
    if spec is None and is_transformers_experts(module):
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


def is_transformers_experts(module: nn.Module) -> bool:
    """What transformers' `use_experts_implementation` sets on every instance it decorates."""
    marks = ("is_transposed", "has_bias", "is_concatenated")
    return all(isinstance(getattr(module, m, None), bool) for m in marks)


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
# checkpoints of docs/design.md, "Formats" leave them. No norm patterns: norms are no linear
# targets, and a
# name such as diffusers' `norm1.linear` or `layernorm_proj` is a real projection. One rule for
# `quantize_`, `gptq_` and `qshard quantize` (qshard/cli/quantize.py).
KEEP_FLOAT = ("*embed*", "lm_head", "*.lm_head", "output", "*pooler*")


def _patterns(patterns: Sequence[str] | str | None) -> list[str] | None:
    return [patterns] if isinstance(patterns, str) else None if patterns is None else list(patterns)


def skip_reason(
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
    if target.param not in target.module._parameters:
        # A parametrization (weight_norm, spectral_norm) or a hook recomputes it from other
        # parameters each forward: a quantized value assigned there would not be the weight.
        return (
            f"its {target.param!r} is computed from other parameters (a parametrization such as "
            "weight_norm or spectral_norm, or a forward hook), not a parameter of its own; "
            "remove it first (torch.nn.utils.parametrize.remove_parametrizations(module, "
            f"{target.param!r}) or torch.nn.utils.remove_spectral_norm(module)) to quantize it"
        )
    local = local_tensor(target.weight)
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
    return [t for t in targets if skip_reason(t, None, exclude, None, keep_float) is None]


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
                raise ConfigError(
                    f"{caller}: {kind} pattern {pattern!r} is not a string; pass "
                    f"fnmatch patterns such as '*.mlp.*'"
                )
            if any(fnmatch.fnmatchcase(n, pattern) for n in names):
                continue
            if not names:
                raise ConfigError(
                    f"{caller}: {kind} pattern {pattern!r} matches nothing: the "
                    f"model has no nn.Linear or expert weight"
                )
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
