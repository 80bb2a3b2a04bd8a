"""Typed reads of the configs other producers write: config.json's `quantization_config`,
ModelOpt's hf_quant_config.json, torchao's per-tensor safetensors metadata.

Every value a format's detect, load or export code reads goes through `Fields`: a JSON type, a
list of N positive sizes, or one of a few choices; anything else is a `CheckpointError` that
names the file, the field's path, the value, the rule and the fix, before the value meets any
arithmetic. A JSON `null` reads as an absent field (producers write None for unset options).

    qc = quantization_config(config, where)        # Fields, or None without one
    block = qc.sizes("weight_block_size", 2)       # (128, 128)
    fmt = qc.choice("fmt", ("e4m3",), default="e4m3")
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..errors import CheckpointError
from ..qtensor import QTensor

# The largest size a config may give (a block side, a group, a dimension): the largest logical
# size a quantized weight may have.
from ..qtensor.validation import MAX_SIZE

__all__ = [
    "MAX_SIZE",
    "REQUIRED",
    "Fields",
    "check_scalar",
    "check_stored",
    "quantization_config",
    "unquantized_modules",
]

REQUIRED: Any = object()  # the default of a field that must be present
DEFAULT_FIX = "Fix the file, or re-export the checkpoint in a form qshard reads"

_JSON_NAMES = {
    dict: "an object",
    list: "a list",
    str: "a string",
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    type(None): "null",
}


def _json_type(value: Any) -> str:
    """The JSON name of `value`'s type ("a string", "an object", ...)."""
    for kind, name in _JSON_NAMES.items():
        if type(value) is kind:
            return name
    return f"a {type(value).__name__}"


def _show(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"{text} ({_json_type(value)})"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Fields:
    """A JSON object read from `where` (a file, or a file and a metadata key), found at `path`
    inside it; its fields read with the type each must have."""

    def __init__(self, data: Any, where: str, path: str = ""):
        self.where, self.path = str(where), path
        if not isinstance(data, dict):
            raise CheckpointError(
                f"{self.where}: {path or 'the content'} is {_show(data)}; it must be a JSON "
                f"object. {DEFAULT_FIX}"
            )
        self.data: dict = data

    def at(self, key: str) -> str:
        """The path of field `key` ("quantization_config.weight_block_size")."""
        return f"{self.path}.{key}" if self.path else key

    def error(self, key: str, value: Any, rule: str, note: str | None = None) -> CheckpointError:
        return CheckpointError(
            f"{self.where}: {self.at(key)} is {_show(value)}; {rule}"
            f"{f' ({note})' if note else ''}. {DEFAULT_FIX}"
        )

    def raw(self, key: str, default: Any = None) -> Any:
        """The value as stored (for comparisons that need no type: `== "fp8"`)."""
        value = self.data.get(key)
        return default if value is None else value

    def _value(self, key: str, default: Any) -> Any:
        value = self.data.get(key)
        if value is None and default is REQUIRED:
            raise CheckpointError(
                f"{self.where}: {self.at(key)} is missing; the format needs it. {DEFAULT_FIX}"
            )
        return value

    def get(self, key: str, kind: type, default: Any = REQUIRED, note: str | None = None) -> Any:
        """The field as a `kind` (dict, list, str, bool, int or float; an int is a float, a
        bool is neither), or `default` when absent."""
        value = self._value(key, default)
        if value is None:
            return default
        ok = type(value) is kind or (kind is float and _is_int(value))
        ok = ok or (kind is int and _is_int(value))
        if ok and kind is float and _is_int(value) and abs(value) > 2**1000:
            ok = False  # an integer no float holds
        if not ok:
            raise self.error(key, value, f"it must be {_JSON_NAMES.get(kind, kind.__name__)}", note)
        return float(value) if kind is float else value

    def choice(
        self,
        key: str,
        choices: Iterable[Any],
        default: Any = REQUIRED,
        note: str | None = None,
        casefold: bool = False,
    ) -> Any:
        """The field, which must be one of `choices`; with `casefold`, a string is read in lower
        case (as compressed-tensors reads its enums)."""
        choices = tuple(choices)
        value = self._value(key, default)
        if value is None:
            return default
        if casefold and isinstance(value, str):
            value = value.lower()
        if not any(type(value) is type(c) and value == c for c in choices):
            raise self.error(key, value, f"it must be one of {list(choices)}", note)
        return value

    def size(
        self, key: str, default: Any = REQUIRED, note: str | None = None, maximum: int = MAX_SIZE
    ) -> int:
        """The field as an integer in 1..maximum."""
        value = self._value(key, default)
        if value is None:
            return default
        if not _is_int(value) or not 1 <= value <= maximum:
            raise self.error(key, value, f"it must be an integer in 1..{maximum}", note)
        return value

    def sizes(
        self,
        key: str,
        count: int,
        default: Any = REQUIRED,
        note: str | None = None,
        maximum: int = MAX_SIZE,
    ) -> tuple[int, ...]:
        """The field as a list of `count` integers, each in 1..maximum."""
        value = self._value(key, default)
        if value is None:
            return default
        ok = isinstance(value, list) and len(value) == count
        if not ok or not all(_is_int(v) and 1 <= v <= maximum for v in value):
            raise self.error(
                key, value, f"it must be a list of {count} integers in 1..{maximum}", note
            )
        return tuple(value)

    def strings(self, key: str, default: Any = REQUIRED, note: str | None = None) -> list[str]:
        """The field as a list of strings."""
        value = self._value(key, default)
        if value is None:
            return default
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(key, value, "it must be a list of strings", note)
        return value

    def child(self, key: str, default: Any = REQUIRED) -> Fields | None:
        """The field, a JSON object, as Fields (or `default` when absent)."""
        value = self._value(key, default)
        if value is None:
            return default
        return Fields(value, self.where, self.at(key))

    def children(self, key: str, default: Any = REQUIRED) -> dict[str, Fields]:
        """The field, an object of objects ({name: {...}}), as {name: Fields}."""
        value = self.get(key, dict, default)
        if value is default:
            return default
        return {
            name: Fields(item, self.where, f"{self.at(key)}.{name}") for name, item in value.items()
        }


def quantization_config(config: Mapping, where: str = "config.json") -> Fields | None:
    """config.json's `quantization_config` as Fields, None if there is none (a float model);
    CheckpointError if it is there but not a JSON object."""
    value = config.get("quantization_config")
    return None if value is None else Fields(value, where, "quantization_config")


def check_stored(
    where: str,
    name: str,
    tensor: torch.Tensor,
    dtypes: torch.dtype | Iterable[torch.dtype],
    shape: Iterable[int | None] | None = None,
) -> torch.Tensor:
    """`tensor` (stored as `name`) if its dtype is one of `dtypes` and its shape is `shape`
    (None: any size on that dim; `shape` None: any shape), else CheckpointError naming the
    tensor, what it is and what the format stores there."""
    dtypes = (dtypes,) if isinstance(dtypes, torch.dtype) else tuple(dtypes)
    shape = None if shape is None else tuple(shape)
    fits = tensor.dtype in dtypes and (
        shape is None
        or (
            tensor.dim() == len(shape)
            and all(s is None or s == t for s, t in zip(shape, tensor.shape, strict=True))
        )
    )
    if not fits:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        want = "" if shape is None else str(["*" if s is None else s for s in shape])
        raise CheckpointError(
            f"{where}: {name} is {str(tensor.dtype).removeprefix('torch.')}"
            f"{list(tensor.shape)}; the format stores {names}{want} there (reinterpreting other "
            f"bytes would give wrong weights). The file is damaged or another format's: "
            f"re-export the checkpoint"
        )
    return tensor


def check_scalar(
    where: str, name: str, tensor: torch.Tensor, dtypes: torch.dtype | Iterable[torch.dtype]
) -> torch.Tensor:
    """`tensor` (stored as `name`) if it is one value ([] or [1]) of one of `dtypes`, else
    CheckpointError."""
    return check_stored(where, name, tensor, dtypes, (1,) if tensor.dim() == 1 else ())


def unquantized_modules(
    state: Mapping[str, torch.Tensor], linear_names: list[str], quantized: Iterable[str]
) -> list[str]:
    """The linears an export leaves in float, for the format's skip list: those of
    `linear_names` (a model's nn.Linear modules) not in `quantized`; for a bare state_dict
    (no names), every 2-D float `<m>.weight` (an embedding too: the skip lists name modules
    readers must not convert, and an extra name is harmless)."""
    quantized = set(quantized)
    if not linear_names:
        linear_names = [
            key.removesuffix(".weight")
            for key, value in state.items()
            if key.endswith(".weight")
            and value.dim() == 2
            and value.is_floating_point()
            and not isinstance(value, QTensor)
        ]
    return [name for name in linear_names if name not in quantized]
