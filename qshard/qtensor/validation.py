"""The one validation of a quantized tensor built from outside data (docs/design.md invariant 9).

Every reader runs `check_qtensor` on every QTensor it builds: `qshard.load` (whole and per-rank
sliced reads), `qshard.load_pretrained` (every format), `torch.load(weights_only=True)` (through
`QTensor.__setstate__`), and `qshard.save` before it writes. `quantize_` runs the value checks on
what it produced, so that it never makes a weight that a reader would refuse. The checks:

1. attributes: the type each layout annotates (enums, bools, ints, tuples of ints), then the
   layout's own rules (`check_attrs`: allowed block and group sizes, with upper bounds);
2. the logical shape: two sizes in [0, MAX_SIZE];
3. inner tensors: plain tensors on one device, each with exactly the shape and dtype that
   `inner_specs` gives for the logical shape and attributes (so the declared shape cannot
   exceed the stored data); unpickling also makes them contiguous (`QTensor.__setstate__`);
4. values: no NaN/Inf in any inner tensor (e4m3 bytes 0x7f/0xff, e8m0 byte 0xff, float NaN/Inf),
   the layout's own value rules (`value_problem`: int4 zero codes are integers in 0..15), and
   every code of every group dequantizes to a finite value of the outer dtype
   (`max_magnitude` <= the dtype's largest finite value).

Failures raise `error` (a `QShardError` subclass: `CheckpointError` for readers) naming `where`,
the rule and what to do.
"""

from __future__ import annotations

import enum
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import CheckpointError, QShardError
from .attrs import attrs_text
from .registry import attr_types

if typing.TYPE_CHECKING:
    from .base import QTensor

# The float dtypes a quantized weight can stand in for (outer dtype) and accept as activations.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

__all__ = [
    "FLOAT_DTYPES",
    "MAX_SIZE",
    "check_attr_types",
    "check_magnitude",
    "check_pickled_state",
    "check_qtensor",
    "check_values",
    "non_finite_count",
]

# Largest logical dim a quantized weight may declare: far above any model's (2^31 elements per
# row or column), far below what overflows index arithmetic.
MAX_SIZE = 2**31 - 1
# Largest element count (E * N * K for experts): an int64 numel with room to spare.
MAX_ELEMENTS = 2**62


def check_chunk(tensor: torch.Tensor) -> int:
    """Elements per step of a value check (NaN/Inf counts, bounds), so that no temporary is the
    size of the weight: 2**16 on CPU, where glibc keeps freed temporaries of 2**20 elements
    mapped (an 8B FP8 checkpoint loaded up to 1.03 GB above its size, 0.07 GB with 2**16:
    bench/README.md), 2**20 on a GPU (fewer launches and host syncs)."""
    return 1 << 16 if tensor.device.type == "cpu" else 1 << 20


def check_qtensor(tensor: QTensor, where: str, error: type[QShardError] = CheckpointError) -> None:
    """Run every check of the module docstring on `tensor`; raise `error` on the first failure.
    Changes nothing (`qshard.save` checks the caller's own tensors)."""
    name = type(tensor).__name__
    at = f"{where}: {name}"
    check_attr_types(type(tensor), tensor.attrs(), at, error)
    shape = tensor.logical_shape
    if not _is_logical_shape(shape):
        raise error(
            f"{at}: logical shape {list(shape)} is not [N, K] or [E, N, K] with sizes in "
            f"0..{MAX_SIZE} and at most {MAX_ELEMENTS} elements"
        )
    if tensor.dtype not in FLOAT_DTYPES:
        raise error(
            f"{at}: stands for a {tensor.dtype}; quantized weights stand for one of "
            f"{[str(d) for d in FLOAT_DTYPES]}"
        )
    specs = type(tensor).inner_specs(shape, tensor.attrs())
    for inner_name, (spec_shape, spec_dtype) in specs.items():
        inner = getattr(tensor, inner_name, None)
        if type(inner) is not torch.Tensor and not isinstance(inner, torch.nn.Parameter):
            raise error(
                f"{at}: inner tensor {inner_name!r} is a {type(inner).__name__}, not a "
                f"plain torch.Tensor"
            )
        if tuple(inner.shape) != tuple(spec_shape) or inner.dtype != spec_dtype:
            raise error(
                f"{at} {list(shape)} with {attrs_text(tensor.attrs())}: inner tensor "
                f"{inner_name!r} is {_dtype(inner.dtype)}{list(inner.shape)}, the layout needs "
                f"{_dtype(spec_dtype)}{list(spec_shape)}"
            )
        if inner.device != tensor.device:
            raise error(
                f"{at}: inner tensor {inner_name!r} is on {inner.device}, the tensor on "
                f"{tensor.device}"
            )
    check_values(tensor, where, error)


def _is_logical_shape(shape: Any) -> bool:
    sizes = isinstance(shape, tuple) and len(shape) in (2, 3)
    sizes = sizes and all(_is_int(s) and 0 <= s <= MAX_SIZE for s in shape)
    return sizes and math.prod(shape) <= MAX_ELEMENTS


# Instance attributes every QTensor has besides its inner tensors and layout attributes, with
# the values a pickle may give them (`QTensor.__getstate__` drops the device form and owner).
_BASE_STATE = {
    "logical_shape": lambda v: isinstance(v, tuple) and len(v) in (2, 3) and all(map(_is_int, v)),
    "transposed": lambda v: type(v) is bool,
    "write_barrier": lambda v: v is None or isinstance(v, str),
    "device_names": lambda v: v == (),
    "device_meta": lambda v: v == (),
    "form_owner": lambda v: v is None,
    "_is_param": lambda v: v is True,  # set by nn.Parameter(qtensor): torch.save(model)
}
_OPTIONAL_BASE_STATE = ("write_barrier", "device_names", "device_meta", "form_owner", "_is_param")


def check_pickled_state(cls: type[QTensor], state: Any, where: str) -> dict[str, Any]:
    """The state a pickle gives a `cls` tensor, checked for its keys and their kinds (no key may
    shadow a method or be missing); the values are then checked by `check_qtensor`."""
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise CheckpointError(
            f"{where}: the pickled state is a {type(state).__name__}, not a dict of attribute names"
        )
    allowed = {*cls.inner_names, *cls.attr_names, *_BASE_STATE}
    required = allowed - set(cls.attr_defaults) - set(_OPTIONAL_BASE_STATE)
    unknown, missing = sorted(set(state) - allowed), sorted(required - set(state))
    if unknown or missing:
        raise CheckpointError(
            f"{where}: the pickled state has unknown keys {unknown} and lacks {missing}; a "
            f"{cls.__name__} has {sorted(allowed)}. The file was not written by torch.save of a "
            f"qshard tensor, or is damaged"
        )
    for key, ok in _BASE_STATE.items():
        if key in state and not ok(state[key]):
            raise CheckpointError(f"{where}: the pickled {key!r} is {state[key]!r}")
    return state


def check_values(tensor: QTensor, where: str, error: type[QShardError] = CheckpointError) -> None:
    """Part 4 of the module docstring: finite codes and scales, the layout's value rules, and
    finite dequantized values. A no-op on the meta device (no values)."""
    if tensor.device.type == "meta":
        return
    at = f"{where}: {type(tensor).__name__}"
    for inner_name, inner in tensor.inner_tensors().items():
        count, first = non_finite_count(inner)
        if count:
            raise error(
                f"{at}: inner tensor {inner_name!r} holds {count} NaN/Inf values (first at "
                f"{first}); the data is corrupt: re-quantize from the float weights"
            )
    problem = tensor.value_problem()
    if problem:
        raise error(f"{at}: {problem}")
    check_magnitude(tensor, where, error)


def check_magnitude(
    tensor: QTensor, where: str, error: type[QShardError] = CheckpointError, fix: str = ""
) -> None:
    """Every code of every group dequantizes to a finite value of the tensor's dtype (run again
    when a load changes the dtype a quantized weight stands for)."""
    if tensor.device.type == "meta":
        return
    at = f"{where}: {type(tensor).__name__}"
    bound, largest = tensor.max_magnitude(), torch.finfo(tensor.dtype).max
    if not bound <= largest:
        raise error(
            f"{at} {list(tensor.logical_shape)}: some codes dequantize to {bound:.4g} in "
            f"magnitude, beyond the largest finite {_dtype(tensor.dtype)} ({largest:.6g}): they "
            f"would become Inf. "
            + (
                fix
                or f"The scales are too large for {_dtype(tensor.dtype)}; the data is "
                f"corrupt, or load it as float32"
            )
        )


def non_finite_count(tensor: torch.Tensor) -> tuple[int, list[int] | None]:
    """(how many NaN/Inf elements `tensor` has, the index of the first), chunked so that no
    temporary is as large as the tensor. Integer dtypes have none."""
    flat, count, first, chunk = tensor.reshape(-1), 0, None, check_chunk(tensor)
    for start in range(0, flat.numel(), chunk):
        bad = _non_finite(flat[start : start + chunk])
        if bad is None:
            return 0, None
        found = int(bad.sum())
        if found and first is None:
            first = start + int(bad.nonzero()[0, 0])
        count += found
    if not count:
        return 0, None
    index = torch.unravel_index(torch.tensor(first), tensor.shape)
    return count, [int(i) for i in index]


def _non_finite(values: torch.Tensor) -> torch.Tensor | None:
    """A mask of the NaN/Inf elements, or None for a dtype that has none."""
    if values.dtype == torch.float8_e4m3fn:
        return (values.view(torch.uint8) & 0x7F) == 0x7F  # no Inf; S.1111.111 is NaN
    if values.dtype == torch.float8_e5m2:
        return (values.view(torch.uint8) & 0x7C) == 0x7C  # exponent all ones: Inf or NaN
    if values.dtype == torch.float8_e8m0fnu:
        return values.view(torch.uint8) == 0xFF  # OCP MX: 0xFF is NaN
    if values.is_floating_point():
        return ~torch.isfinite(values)
    return None


def check_attr_types(
    cls: type[QTensor],
    attrs: Mapping[str, Any],
    where: str,
    error: type[QShardError] = CheckpointError,
) -> None:
    """Every attribute of the layout, of its annotated type, and valid by `cls.check_attrs`."""
    hints = attr_types(cls)
    if set(attrs) != set(hints):
        raise error(f"{where}: attributes {sorted(attrs)}; {cls.__name__} has {sorted(hints)}")
    for name, hint in hints.items():
        if not _has_type(attrs[name], hint):
            raise error(
                f"{where}: attribute {name!r} is {attrs[name]!r} ({type(attrs[name]).__name__}),"
                f" not a {_hint_text(hint)}"
            )
    try:
        cls.check_attrs(attrs)
    except QShardError as e:
        raise error(f"{where}: attributes {attrs_text(attrs)} are invalid: {e}") from None


def _has_type(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if args and args[-1] is Ellipsis:
            return all(_has_type(v, args[0]) for v in value)
        return len(value) == len(args) and all(map(_has_type, value, args))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return isinstance(value, hint)
    if hint is bool:
        return type(value) is bool
    if hint is int:
        return _is_int(value)
    if hint is float:
        return isinstance(value, float) or _is_int(value)
    if hint is str:
        return isinstance(value, str)
    return False


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _hint_text(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
