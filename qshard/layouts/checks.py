"""Input checks shared by the layouts' `from_float` and `_linear` (typed errors, docs/design.md
invariant 4)."""

from __future__ import annotations

from typing import Any

import torch

from ..config import Backend
from ..errors import (
    BackendUnavailableError,
    ConfigError,
    InputMismatchError,
    NonFiniteWeightError,
    UnsupportedWeightError,
)
from ..kernels.availability import triton_unavailable_reason
from ..kernels.loader import load_grouped_ops
from ..qtensor import FLOAT_DTYPES, QTensor
from ..qtensor.validation import check_chunk, check_magnitude

__all__ = [
    "abs_max",
    "check_activation",
    "check_float_weight",
    "checked_config",
    "quantized",
    "rows_max",
    "weight_only_backend",
    "weight_only_grouped_linear",
]


def quantized(tensor: QTensor) -> QTensor:
    """A layout's `from_float` result, or UnsupportedWeightError (quantize_ skips and reports the
    weight) if some code of some group would dequantize beyond the weight dtype's largest finite
    value: weights within about one quantization step of it (fp16 weights near +-65504, an FP8
    UE8M0 scale rounded up past it). Such a weight would save, load and compute Inf."""
    fix = (
        f"The weight has values within about one quantization step of the largest "
        f"{str(tensor.dtype).removeprefix('torch.')}; scale it down, or quantize a float32 copy"
    )
    check_magnitude(tensor, f"{type(tensor).__name__}.from_float", UnsupportedWeightError, fix)
    return tensor


def abs_max(tensor: torch.Tensor) -> float:
    """max |tensor| as a Python float (float64), 0.0 for an empty tensor: the scale factor of a
    layout's `max_magnitude` bound."""
    return rows_max(lambda t: t.float().abs(), tensor)


def rows_max(fn, *tensors: torch.Tensor) -> float:
    """The largest value of `fn(*parts)` over blocks of rows of `tensors` (each [N, ...], cut
    alike), about `check_chunk` elements at a time so that a load's peak memory stays the
    quantized size (tests/io/test_memory.py); 0.0 when there is nothing."""
    first = tensors[0]
    rows = first.shape[0] if first.dim() else 1
    step = max(1, check_chunk(first) // max(1, first.numel() // max(rows, 1)))
    best = 0.0
    for start in range(0, rows, step):
        value = fn(*(t.detach()[start : start + step] for t in tensors))
        if value.numel():
            best = max(best, float(value.amax()))
    return best


def check_float_weight(layout: str, weight: Any) -> None:
    """A 2-D finite float tensor, or UnsupportedWeightError / NonFiniteWeightError."""
    if not isinstance(weight, torch.Tensor) or isinstance(weight, QTensor):
        raise UnsupportedWeightError(
            f"{layout}.from_float takes a float torch.Tensor, got {type(weight).__name__}"
        )
    if weight.dim() != 2:
        raise UnsupportedWeightError(
            f"{layout}: weight of shape {list(weight.shape)} is {weight.dim()}-D; "
            f"a linear weight is 2-D [out_features, in_features]"
        )
    if weight.dtype not in FLOAT_DTYPES:
        raise UnsupportedWeightError(
            f"{layout}: weight dtype {weight.dtype} is not one of "
            f"{[str(d) for d in FLOAT_DTYPES]}; cast it to bfloat16 first"
        )
    if weight.device.type != "meta":
        bad = ~torch.isfinite(weight)
        if bool(bad.any()):
            first = [int(i) for i in bad.nonzero()[0]]
            raise NonFiniteWeightError(
                f"{layout}: weight of shape {list(weight.shape)} has {int(bad.sum())} "
                f"NaN/Inf values (first at {first}); fix the weights before quantizing"
            )


def check_activation(weight: QTensor, x: torch.Tensor) -> None:
    """x [..., K] in a float dtype for the weight [N, K], or InputMismatchError."""
    k = weight.logical_shape[-1]
    features = x.shape[-1] if x.dim() else 0
    if x.dim() == 0 or features != k:
        raise InputMismatchError(
            f"linear: input of shape {list(x.shape)} has {features} features; the "
            f"{type(weight).__name__} weight {list(weight.logical_shape)} takes {k} (inputs are "
            f"[..., {k}])"
        )
    if x.dtype not in FLOAT_DTYPES:
        raise InputMismatchError(
            f"linear: input dtype {x.dtype} is not one of {[str(d) for d in FLOAT_DTYPES]}; "
            f"cast the input to {weight.dtype}"
        )


def checked_config(layout: str, config_cls: type, config: Any) -> Any:
    """`config`, or the default `config_cls()` for None; ConfigError for another type."""
    if config is None:
        return config_cls()
    if not isinstance(config, config_cls):
        raise ConfigError(
            f"{layout}.from_float: config {config!r} is not a {config_cls.__name__} instance; "
            f"pass e.g. {config_cls.__name__}()"
        )
    return config


def weight_only_backend(weight: QTensor, x: torch.Tensor) -> Backend:
    """The backend of a 4-bit weight-only matmul (int4, MXFP4, NVFP4) for input x.

    `auto`: the Triton kernels (`kernels/w4a16/`) on a CUDA GPU where they can run
    (sm_80+), else REFERENCE, which the layouts' `_linear` runs as dequantize + BLAS (never the
    interpreter) unless the weight's backend is `reference` itself. `reference`: always the
    float64 reference. `triton`: the kernels, or BackendUnavailableError naming why they cannot
    run here."""
    backend = weight.backend
    if backend is Backend.REFERENCE:
        return Backend.REFERENCE
    reason = triton_unavailable_reason(x.device, fp8=False)
    if backend is Backend.TRITON:
        if reason:
            raise BackendUnavailableError(
                f"{type(weight).__name__} {list(weight.logical_shape)}: backend 'triton' cannot "
                f"run here: {reason}; use backend='auto' or 'reference'"
            )
        return Backend.TRITON
    return Backend.TRITON if x.device.type == "cuda" and reason is None else Backend.REFERENCE


def weight_only_grouped_linear(
    weight: QTensor,
    x: torch.Tensor,
    offs: torch.Tensor,
    bias: torch.Tensor | None,
    fmt: str,
    group: int,
    zero: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`grouped_linear` of 4-bit experts (int4, MXFP4, NVFP4; `fmt` names the kernel's format):
    the fused grouped kernel (kernels/grouped/) where `weight_only_backend` picks
    Triton, else each expert's reference (QTensor.grouped_linear)."""
    check_activation(weight, x)
    if weight_only_backend(weight, x) is not Backend.TRITON:
        return QTensor.grouped_linear(weight, x, offs, bias)
    load_grouped_ops()
    empty = weight.qdata.new_empty(0)
    return torch.ops.qshard.w4a16_grouped_linear(
        x,
        offs,
        weight.qdata,
        weight.scale,
        empty if zero is None else zero,
        empty if global_scale is None else global_scale,
        bias,
        fmt,
        group,
        weight.logical_shape[-1],
    )
