"""The layout registry: a layout is usable by `quantize_`, `torch.load(weights_only=True)` and the
contract suite by being registered here, with no other list to keep."""

from __future__ import annotations

import enum

import torch

from ..api import register_handler
from ..config import Backend, QuantConfig, ScaleFormat
from ..qtensor import QTensor

__all__ = ["config_class_of", "register_layout", "registered_layouts"]

_LAYOUTS: dict[type[QTensor], type[QuantConfig]] = {}


def register_layout(config_cls: type[QuantConfig], *safe_enums: type[enum.Enum]):
    """Class decorator: register a QTensor layout and the config that produces it."""

    def decorator(tensor_cls: type[QTensor]) -> type[QTensor]:
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
