"""The layout registry and the handler table: a layout is usable by `quantize_`,
`torch.load(weights_only=True)`, `qshard.save`/`qshard.load` and the contract suite by being
registered here, with no other list to keep. A config class maps to a handler,
`handler(weight, config) -> QTensor` (`register_handler`; a registered layout's handler is its
`from_float`)."""

from __future__ import annotations

import enum
import typing
from collections.abc import Callable

import torch

from ..config import Backend, QuantConfig, ScaleFormat
from ..errors import ConfigError

if typing.TYPE_CHECKING:
    from .base import QTensor

__all__ = [
    "attr_types",
    "config_class_of",
    "handler_for",
    "layout_by_name",
    "layout_for",
    "register_handler",
    "register_layout",
    "registered_layouts",
]

Handler = Callable[[torch.Tensor, QuantConfig], "QTensor"]

_HANDLERS: dict[type[QuantConfig], Handler] = {}
_LAYOUTS: dict[type[QTensor], type[QuantConfig]] = {}
_ATTR_TYPES: dict[type[QTensor], dict[str, typing.Any]] = {}


def register_handler(config_cls: type[QuantConfig], handler: Handler | None = None):
    """Register `handler(weight, config) -> QTensor` for `config_cls` (usable as a decorator)."""

    def decorator(fn: Handler) -> Handler:
        _HANDLERS[config_cls] = fn
        return fn

    return decorator(handler) if handler is not None else decorator


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


def register_layout(config_cls: type[QuantConfig], *safe_enums: type[enum.Enum]):
    """Class decorator: register a QTensor layout and the config that produces it."""

    def decorator(tensor_cls: type[QTensor]) -> type[QTensor]:
        if tensor_cls.__name__ in {c.__name__ for c in _LAYOUTS if c is not tensor_cls}:
            raise TypeError(f"a layout named {tensor_cls.__name__} is registered already")
        # Checkpoints store attributes as JSON and decode them by these annotations, so a
        # layout whose attributes lack one could be saved but not loaded: refuse it here.
        hints = typing.get_type_hints(tensor_cls)
        missing = [name for name in tensor_cls.attr_names if name not in hints]
        if missing:
            raise TypeError(
                f"{tensor_cls.__name__}: attributes {missing} need a class-level type annotation "
                f"(qshard.load decodes checkpoint metadata by it)"
            )
        _ATTR_TYPES[tensor_cls] = {name: hints[name] for name in tensor_cls.attr_names}
        _LAYOUTS[tensor_cls] = config_cls
        register_handler(config_cls, tensor_cls.from_float)
        # torch.load(weights_only=True) rebuilds the subclass and its enum attributes only
        # from allow-listed globals.
        torch.serialization.add_safe_globals([tensor_cls, Backend, ScaleFormat, *safe_enums])
        return tensor_cls

    return decorator


def registered_layouts() -> list[type[QTensor]]:
    return list(_LAYOUTS)


def config_class_of(tensor_cls: type[QTensor]) -> type[QuantConfig]:
    return _LAYOUTS[tensor_cls]


def layout_for(config: QuantConfig) -> type[QTensor]:
    """The registered layout that `config` (an instance of its config class) quantizes to."""
    return next(cls for cls, config_cls in _LAYOUTS.items() if config_cls is type(config))


def layout_by_name(name: str) -> type[QTensor] | None:
    """The registered layout class called `name`, or None."""
    return next((cls for cls in _LAYOUTS if cls.__name__ == name), None)


def attr_types(tensor_cls: type[QTensor]) -> dict[str, typing.Any]:
    """{attribute name: its annotated type} of a registered layout."""
    return _ATTR_TYPES[tensor_cls]
