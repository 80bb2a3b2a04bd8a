"""The attribute codec: a layout's attributes (`QTensor.attrs()`) as JSON values and back,
decoded by the layout's type annotations (enums by value, tuples as lists) and checked by its
`check_attrs`. Checkpoint headers (io/format.py) and the experts custom ops (qtensor/grouped.py),
which pass a QTensor to a torch.library op as plain values, use it alike."""

from __future__ import annotations

import enum
import json
import types
import typing
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import CheckpointError, QShardError
from .registry import attr_types, layout_by_name

if typing.TYPE_CHECKING:
    from .base import QTensor

__all__ = ["attr_to_json", "attrs_text", "decode_attrs", "expect", "op_args", "rebuild"]


def attr_to_json(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [attr_to_json(v) for v in value]
    return value


def decode_attrs(layout: type[QTensor], raw: dict, at: str) -> dict[str, Any]:
    types_ = attr_types(layout)
    raw = {**{n: attr_to_json(v) for n, v in layout.attr_defaults.items()}, **raw}
    if sorted(raw) != sorted(types_):
        raise CheckpointError(
            f"{at}: attributes {sorted(raw)}; {layout.__name__} has {sorted(types_)}"
        )
    attrs = {
        name: _decode_value(raw[name], hint, f"{at} attribute {name!r}")
        for name, hint in types_.items()
    }
    try:
        layout.check_attrs(attrs)
    except QShardError as e:
        raise CheckpointError(f"{at}: attributes {attrs_text(attrs)} are invalid: {e}") from None
    return attrs


def _decode_value(value: Any, hint: Any, at: str) -> Any:
    """`value` (JSON) as the annotated type `hint`, or CheckpointError."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        return _decode_value(value, hint, at)
    if origin is tuple:
        if not isinstance(value, list) or (args[-1] is not Ellipsis and len(value) != len(args)):
            raise CheckpointError(f"{at}: {value!r} is not a list of {len(args)} values")
        item_types = [args[0]] * len(value) if args[-1] is Ellipsis else args
        return tuple(_decode_value(v, t, at) for v, t in zip(value, item_types, strict=True))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            choices = [m.value for m in hint]
            raise CheckpointError(f"{at}: {value!r} is not one of {choices}") from None
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (bool, int, float, str):
        return expect(value, hint, hint.__name__, at)
    raise CheckpointError(f"{at}: qshard cannot decode attributes of type {hint!r}")


def expect(value: Any, kind: type, what: str, at: str) -> Any:
    # bool is an int subclass, and an int where a bool is expected is a damaged file.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CheckpointError(f"{at}: {what} {value!r} is not a {kind.__name__}")
    return value


def attrs_text(attrs: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={attr_to_json(v)!r}" for k, v in attrs.items())


def op_args(w: QTensor) -> tuple:
    """(inner tensors, layout name, JSON attributes, dtype, logical shape): how the generic
    experts ops receive a QTensor."""
    attrs = json.dumps({name: attr_to_json(v) for name, v in w.attrs().items()})
    inner = [getattr(w, name) for name in w.inner_names]
    return inner, type(w).__name__, attrs, w.dtype, list(w.logical_shape)


def rebuild(inner: list[torch.Tensor], layout: str, attrs: str, dtype, shape) -> QTensor:
    cls = layout_by_name(layout)
    decoded = decode_attrs(cls, json.loads(attrs), f"qshard::experts_linear({layout})")
    inner = dict(zip(cls.inner_names, inner, strict=True))
    return cls(inner, shape=tuple(shape), dtype=dtype, **decoded)
