"""Typed errors. Every user-facing error qshard raises derives from `QShardError`.

Messages give the value, the rule it broke and the fix.
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailableError",
    "CheckpointError",
    "ConfigError",
    "ExpertParallelError",
    "InputMismatchError",
    "InvalidDimError",
    "LayoutMismatchError",
    "MisalignedSliceError",
    "NonFiniteWeightError",
    "NotQuantizedError",
    "QShardError",
    "UnsupportedOpError",
    "UnsupportedWeightError",
]


class QShardError(Exception):
    """Base class of every error qshard raises on bad input or unsupported use."""


class ConfigError(QShardError, ValueError):
    """A config field has a value the config does not accept."""


class UnsupportedWeightError(QShardError, ValueError):
    """A layout cannot take this weight (rank, dtype, shape). `quantize_` skips and reports it."""


class NonFiniteWeightError(QShardError, ValueError):
    """A weight holds NaN or Inf; quantizing it would hide the problem in a scale."""


class NotQuantizedError(QShardError, ValueError):
    """A model or state_dict holds no quantized weight where one is needed (`qshard.export`)."""


class InputMismatchError(QShardError, ValueError):
    """An activation's shape or dtype does not fit the quantized weight it meets."""


class InvalidDimError(QShardError, IndexError):
    """A dim argument that a 2-D quantized weight does not have."""


class MisalignedSliceError(QShardError, ValueError):
    """A slice cuts through a block or packed element and cannot be made exact."""


class LayoutMismatchError(QShardError, ValueError):
    """Two quantized tensors that must share a layout (copy_, cat) do not."""


class UnsupportedOpError(QShardError, NotImplementedError):
    """An op that a quantized tensor class does not implement."""


class BackendUnavailableError(QShardError, RuntimeError):
    """A requested kernel backend cannot run here; qshard never substitutes another silently."""


class CheckpointError(QShardError, ValueError):
    """A checkpoint file that is damaged, inconsistent, or does not fit the model it loads into."""


class ExpertParallelError(QShardError, ValueError):
    """An experts module that cannot be sharded over this mesh by the chosen style (qshard.tp:
    ExpertParallel, ExpertTensorParallel)."""
