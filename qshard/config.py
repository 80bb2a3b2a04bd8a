"""Quantization configs: frozen dataclasses, serializable to JSON with a version.

Inside the library configs hold enums; strings are parsed only at the edges (a config's
constructor, `from_dict`, the CLI).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import operator
from typing import Any, ClassVar

from .errors import ConfigError

__all__ = ["Backend", "QuantConfig", "ScaleFormat", "config_from_dict", "parse_backend"]

CONFIG_FORMAT_VERSION = 1


class Backend(str, enum.Enum):
    """Which implementation runs a quantized matmul."""

    AUTO = "auto"  # the layout picks by device and shape (its `select_backend`)
    REFERENCE = "reference"  # plain PyTorch, any device; the definition of the result
    TRITON = "triton"
    CUBLAS = "cublas"
    GEMLITE = "gemlite"
    TINYGEMM = "tinygemm"


class ScaleFormat(str, enum.Enum):
    """How a per-block scale is stored and rounded."""

    FP32 = "fp32"  # amax / max_representable, as is
    UE8M0 = "ue8m0"  # rounded up to a power of two (DeepSeek-V3 `scale_fmt: ue8m0`)


def parse_enum(enum_cls: type[enum.Enum], value: Any, field: str, owner: str) -> enum.Enum:
    """A string (or the enum itself) as `enum_cls`, or a ConfigError listing the choices."""
    if isinstance(value, enum_cls):
        return value
    try:
        return enum_cls(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in enum_cls)
        raise ConfigError(f"{owner}: {field}={value!r} is not one of {choices}") from None


def as_int(value: Any) -> Any:
    """An integer of any integral type (a numpy integer) as a plain int, so that configs compare,
    hash and save alike; anything else (a float, a bool, a string) unchanged, for the caller's
    check to refuse by name."""
    if isinstance(value, bool):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


def parse_backend(value: Any, available: tuple[Backend, ...], owner: str) -> Backend:
    """`value` as a Backend that this version of `owner`'s layout implements, or ConfigError."""
    backend = parse_enum(Backend, value, "backend", owner)
    if backend not in available:
        raise ConfigError(
            f"{owner}: backend={backend.value!r} is not available in this qshard version; "
            f"available: {[b.value for b in available]}"
        )
    return backend


_CONFIG_TYPES: dict[str, type[QuantConfig]] = {}


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Base of every config. Subclasses are frozen dataclasses and register by subclassing."""

    version: ClassVar[int] = CONFIG_FORMAT_VERSION

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _CONFIG_TYPES[cls.__name__] = cls

    def _set(self, name: str, value: Any) -> None:
        """Normalize a field in __post_init__ (the dataclass is frozen)."""
        object.__setattr__(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": type(self).__name__, "version": self.version}
        for field in dataclasses.fields(self):
            out[field.name] = _to_json_value(getattr(self, field.name))
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QuantConfig:
        return config_from_dict(data, expected=cls)


def _to_json_value(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [_to_json_value(v) for v in value]
    return value


def config_from_dict(
    data: dict[str, Any], expected: type[QuantConfig] | None = None
) -> QuantConfig:
    """Rebuild a config from `QuantConfig.to_dict()` output (or its JSON)."""
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"config JSON does not parse ({e}); expected QuantConfig.to_json()"
            ) from None
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise ConfigError(
            f"config {data!r} has no string 'type' key; expected QuantConfig.to_dict() output"
        )
    name = data["type"]
    cls = _CONFIG_TYPES.get(name)
    if cls is None or cls is QuantConfig:
        known = ", ".join(sorted(k for k in _CONFIG_TYPES if k != "QuantConfig"))
        raise ConfigError(f"config type {name!r} is unknown; known types: {known}")
    if expected is not None and expected is not QuantConfig and not issubclass(cls, expected):
        raise ConfigError(f"config type {name!r} is not a {expected.__name__}")
    version = data.get("version", CONFIG_FORMAT_VERSION)
    if not isinstance(version, int) or version > cls.version:
        raise ConfigError(
            f"{name}: config version {version!r} is newer than this qshard reads "
            f"(<= {cls.version}); upgrade qshard"
        )
    field_names = {f.name for f in dataclasses.fields(cls)}
    fields = {k: v for k, v in data.items() if k not in ("type", "version")}
    unknown = sorted(set(fields) - field_names)
    if unknown:
        raise ConfigError(f"{name}: unknown fields {unknown}; known fields: {sorted(field_names)}")
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
    return cls(**fields)
