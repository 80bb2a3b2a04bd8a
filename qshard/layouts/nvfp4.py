"""NVFP4 weight-only layout: e2m1 weights, an e4m3 scale per 16 values, one fp32 global scale.

Inner tensors (logical weight [N, K], G = ceil(K / 16)):
    qdata  uint8 [N, ceil(K/2)]          two e2m1 codes per byte along K, the even index in the
                                         low nibble
    scale  float8_e4m3fn [N, G]          block scale per row per 16 values (the last may be partial)
    global_scale  float32 [1, 1]         the per-tensor multiplier amax / (6 * 448) (ModelOpt's
                                         weight_scale_2): W = e2m1 * scale * global_scale
Attributes:
    backend       AUTO (the fused Triton kernels, `kernels/w4a16/`, on a CUDA GPU;
                  dequantize + BLAS elsewhere), REFERENCE, or TRITON (forced)
    global_divisor  None, or the fp32 divisor d a compressed-tensors checkpoint stored, whose
                  fl(1/d) is global_scale: x -> 1/x is not injective on fp32, so d cannot be
                  recovered from global_scale; export writes it back where fl(1/d) still equals
                  global_scale. Provenance only: no arithmetic reads it, and layout_difference
                  ignores it.

Quantization: `qshard/kernels/nvfp4.py`. Packing for the shape ops: qdata (1, 2), scale (1, 16):
rows slice anywhere, columns at multiples of 16 (the finest block: no re-grouping); the global
scale covers the whole weight, so every part (a slice, a TP shard) shares its parent's, and
`quantize_like` quantizes a part with it.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from typing import ClassVar

import torch

from ..config import Backend, QuantConfig, parse_backend
from ..errors import ConfigError, UnsupportedWeightError
from ..kernels.loader import load_w4a16_ops
from ..kernels.nvfp4 import (
    E2M1_MAX,
    GROUP,
    SCALE_DTYPE,
    dequantize_nvfp4,
    global_scale_of,
    nvfp4_linear_reference,
    quantize_nvfp4,
)
from ..kernels.packing import linear_in_dtype
from ..qtensor import QTensor
from ..qtensor.registry import register_layout
from .checks import (
    abs_max,
    check_activation,
    check_float_weight,
    checked_config,
    quantized,
    weight_only_backend,
    weight_only_grouped_linear,
)

__all__ = ["NVFP4_MIN_SQNR_DB", "NVFP4WeightOnlyConfig", "Nvfp4Tensor"]

# F.linear vs float on Gaussian weights: relative error 0.095 (20.4 dB) on [4096, 4096].
NVFP4_MIN_SQNR_DB = 17.0
AVAILABLE_BACKENDS = (Backend.AUTO, Backend.REFERENCE, Backend.TRITON)


@dataclasses.dataclass(frozen=True)
class NVFP4WeightOnlyConfig(QuantConfig):
    """e2m1 weights, an e4m3 scale per 16 input channels and an fp32 per-tensor scale."""

    backend: Backend = Backend.AUTO

    def __post_init__(self):
        self._set("backend", parse_backend(self.backend, AVAILABLE_BACKENDS, type(self).__name__))


@register_layout(NVFP4WeightOnlyConfig)
class Nvfp4Tensor(QTensor):
    """An NVFP4 weight. See the module docstring."""

    inner_names = ("qdata", "scale", "global_scale")
    attr_names = ("backend", "global_divisor")
    attr_defaults: ClassVar[dict] = {"global_divisor": None}
    min_linear_sqnr_db: ClassVar[float] = NVFP4_MIN_SQNR_DB

    qdata: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor
    backend: Backend
    global_divisor: float | None

    @classmethod
    def quantize_matrix(
        cls,
        weight: torch.Tensor,
        config: NVFP4WeightOnlyConfig | None = None,
        global_scale: torch.Tensor | None = None,
        group_params: dict[str, torch.Tensor] | None = None,
    ) -> Nvfp4Tensor:
        """Quantize `weight`, with its own global scale unless one (a parent's) is given; with
        `group_params` ({"scale"}: e4m3 [N, ceil(K/16)], e.g. chosen by `qshard.gptq_`) round
        with those block scales instead of the blocks' own."""
        config = checked_config(cls.__name__, NVFP4WeightOnlyConfig, config)
        check_float_weight(cls.__name__, weight)
        weight = weight.detach()
        if global_scale is None:
            global_scale = global_scale_of(weight)
        scale = group_params["scale"] if group_params else None
        qdata, scale = quantize_nvfp4(weight, global_scale, GROUP, scale)
        return quantized(
            cls(
                {"qdata": qdata, "scale": scale, "global_scale": global_scale.clone()},
                shape=tuple(weight.shape),
                dtype=weight.dtype,
                backend=config.backend,
            )
        )

    @classmethod
    def from_float_part(cls, part, whole, config) -> Nvfp4Tensor:
        if whole.dim() == 3:  # experts: each part of an expert takes that expert's scale
            if part.dim() != 3 or part.shape[0] != whole.shape[0]:
                raise UnsupportedWeightError(
                    f"Nvfp4Tensor.from_float_part: a part {list(part.shape)} of experts "
                    f"{list(whole.shape)} that is not a part of every expert; quantize the "
                    f"whole experts, then shard them (each expert keeps its global scale)"
                )
            scales = torch.stack([global_scale_of(expert) for expert in whole.unbind(0)])
            return cls.from_float(part, config, global_scale=scales.to(part.device))
        return cls.from_float(part, config, global_scale=global_scale_of(whole).to(part.device))

    def quantize_matrix_like(self, weight: torch.Tensor, at=(0, 0)) -> Nvfp4Tensor:
        return type(self).from_float(weight, self.config(), global_scale=self.global_scale)

    @classmethod
    def contract_configs(cls) -> list[NVFP4WeightOnlyConfig]:
        return [NVFP4WeightOnlyConfig()]

    def config(self) -> NVFP4WeightOnlyConfig:
        return NVFP4WeightOnlyConfig(self.backend)

    @classmethod
    def check_attrs(cls, attrs) -> None:
        NVFP4WeightOnlyConfig(attrs["backend"])  # the backend is a config field, checked there
        d = attrs.get("global_divisor")
        try:  # a positive finite float32 value (the dtype the checkpoint stores it in)
            fp32 = struct.unpack("<f", struct.pack("<f", d))[0] if d is not None else None
            ok = d is None or (type(d) is not bool and math.isfinite(d) and d > 0 and fp32 == d)
        except (TypeError, OverflowError, struct.error):  # not a number, or beyond float32
            ok = False
        if not ok:
            raise ConfigError(
                f"Nvfp4Tensor: global_divisor {d!r} is not a positive finite float32 value "
                f"(the divisor a compressed-tensors checkpoint stored); None when there is none"
            )

    def layout_difference(self, other: QTensor) -> str | None:
        # global_divisor is provenance, not layout (the module docstring).
        if isinstance(other, Nvfp4Tensor) and other.global_divisor != self.global_divisor:
            other = other.with_changes(global_divisor=self.global_divisor)
        return super().layout_difference(other)

    # ---- hooks for the shared shape ops ---------------------------------------------------

    def packing(self) -> dict[str, tuple[int, int] | None]:
        return {"qdata": (1, 2), "scale": (1, GROUP), "global_scale": None}

    @classmethod
    def matrix_specs(cls, shape, attrs):
        (n, k), groups = shape, -(-shape[1] // GROUP)
        return {
            "qdata": ((n, -(-k // 2)), torch.uint8),
            "scale": ((n, groups), SCALE_DTYPE),
            "global_scale": ((1, 1), torch.float32),
        }

    def matrix_max_magnitude(self) -> float:
        return E2M1_MAX * abs_max(self.scale) * abs_max(self.global_scale)

    def matrix_value_problem(self) -> str | None:
        scale = float(self.global_scale.reshape(-1)[0]) if self.global_scale.numel() else 1.0
        if not scale > 0:
            return (
                f"global_scale {scale} is not positive "
                f"(a multiplier, amax / (6 * 448): ModelOpt's weight_scale_2, or 1 / "
                f"compressed-tensors' weight_global_scale)"
            )
        return None

    def dequantize_matrix(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        k = self.logical_shape[-1]
        weight = dequantize_nvfp4(
            self.qdata, self.scale, self.global_scale, GROUP, k, dtype or self.dtype
        )
        return weight.t() if self.transposed else weight

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        check_activation(self, x)
        if self.select_backend(x) is Backend.TRITON:
            load_w4a16_ops()
            return torch.ops.qshard.nvfp4_linear(
                x, self.qdata, self.scale, self.global_scale, bias, GROUP
            )
        if self.backend is Backend.REFERENCE:
            return nvfp4_linear_reference(x, self.qdata, self.scale, self.global_scale, GROUP, bias)
        # auto where no qshard kernel runs (the CPU): the reference's weight, the BLAS's sums.
        k = self.logical_shape[-1]
        weight = dequantize_nvfp4(self.qdata, self.scale, self.global_scale, GROUP, k, x.dtype)
        return linear_in_dtype(x, weight, bias)

    def grouped_linear(self, x, offs, bias=None):
        return weight_only_grouped_linear(
            self, x, offs, bias, "nvfp4", GROUP, global_scale=self.global_scale
        )

    def select_backend(self, x: torch.Tensor) -> Backend:
        return weight_only_backend(self, x)
