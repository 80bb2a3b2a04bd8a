"""MXFP4 weight-only layout (OCP MX v1.0): e2m1 weights, an e8m0 (power-of-two) scale per 32.

Inner tensors (logical weight [N, K], G = ceil(K / group_size)):
    qdata  uint8 [N, ceil(K/2)]          two e2m1 codes per byte along K, the even index in the
                                         low nibble; W[n, k] = e2m1(code) * scale[n, k // g]
    scale  float8_e8m0fnu [N, G]         2**e per row per block (the last block may be partial)
Attributes:
    group_size  32 (the MX block); finer (16) after a TP cut re-groups a block exactly
    backend     AUTO (the fused Triton kernels, `kernels/w4a16/`, on a CUDA GPU;
                dequantize + BLAS elsewhere), REFERENCE, or TRITON (forced)

Quantization (scale rule, rounding, saturation): `qshard/kernels/mxfp4.py`. Packing for the
shape ops: qdata (1, 2), scale (1, group_size). Rows slice anywhere; columns at block boundaries;
a cut at a multiple of 16 re-groups exactly (each scale repeated), as the int4 layout does.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from ..config import Backend, QuantConfig, parse_backend
from ..errors import ConfigError, MisalignedSliceError
from ..kernels.loader import load_w4a16_ops
from ..kernels.mxfp4 import (
    E2M1_MAX,
    GROUP,
    SCALE_DTYPE,
    dequantize_mxfp4,
    mxfp4_linear_reference,
    quantize_mxfp4,
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

__all__ = ["MXFP4_MIN_SQNR_DB", "MXFP4WeightOnlyConfig", "Mxfp4Tensor"]

MIN_GROUP = 16  # the finest re-grouping of a TP cut
# F.linear vs float on Gaussian weights: relative error 0.114 (19 dB) on [4096, 4096]; the
# contract suite's small shapes scatter around that.
MXFP4_MIN_SQNR_DB = 17.0
AVAILABLE_BACKENDS = (Backend.AUTO, Backend.REFERENCE, Backend.TRITON)


@dataclasses.dataclass(frozen=True)
class MXFP4WeightOnlyConfig(QuantConfig):
    """e2m1 weights with an e8m0 scale per 32 input channels; activations stay bf16/fp16."""

    backend: Backend = Backend.AUTO

    def __post_init__(self):
        self._set("backend", parse_backend(self.backend, AVAILABLE_BACKENDS, type(self).__name__))


@register_layout(MXFP4WeightOnlyConfig)
class Mxfp4Tensor(QTensor):
    """An MXFP4 weight. See the module docstring."""

    inner_names = ("qdata", "scale")
    attr_names = ("group_size", "backend")
    min_linear_sqnr_db: ClassVar[float] = MXFP4_MIN_SQNR_DB

    qdata: torch.Tensor
    scale: torch.Tensor
    group_size: int
    backend: Backend

    @classmethod
    def quantize_matrix(
        cls,
        weight: torch.Tensor,
        config: MXFP4WeightOnlyConfig | None = None,
        group_params: dict[str, torch.Tensor] | None = None,
    ) -> Mxfp4Tensor:
        """Quantize `weight`; with `group_params` ({"scale"}: e8m0 [N, ceil(K/32)], e.g. chosen
        by `qshard.gptq_`) round with those scales instead of the blocks' own."""
        config = checked_config(cls.__name__, MXFP4WeightOnlyConfig, config)
        check_float_weight(cls.__name__, weight)
        scale = group_params["scale"] if group_params else None
        qdata, scale = quantize_mxfp4(weight.detach(), GROUP, scale)
        return quantized(
            cls(
                {"qdata": qdata, "scale": scale},
                shape=tuple(weight.shape),
                dtype=weight.dtype,
                group_size=GROUP,
                backend=config.backend,
            )
        )

    @classmethod
    def contract_configs(cls) -> list[MXFP4WeightOnlyConfig]:
        return [MXFP4WeightOnlyConfig()]

    def config(self) -> MXFP4WeightOnlyConfig:
        return MXFP4WeightOnlyConfig(self.backend)

    @classmethod
    def check_attrs(cls, attrs) -> None:
        group = attrs["group_size"]
        if group not in (MIN_GROUP, GROUP):
            raise ConfigError(
                f"Mxfp4Tensor: group_size {group} is not {GROUP} (the MX block) or {MIN_GROUP} "
                f"(a re-grouped TP cut)"
            )
        MXFP4WeightOnlyConfig(attrs["backend"])

    # ---- hooks for the shared shape ops ---------------------------------------------------

    def packing(self) -> dict[str, tuple[int, int] | None]:
        return {"qdata": (1, 2), "scale": (1, self.group_size)}

    @classmethod
    def matrix_specs(cls, shape, attrs):
        (n, k), groups = shape, -(-shape[1] // attrs["group_size"])
        return {"qdata": ((n, -(-k // 2)), torch.uint8), "scale": ((n, groups), SCALE_DTYPE)}

    def _realign_misaligned(self, dim: int, offsets: list[int]) -> Mxfp4Tensor:
        """Re-group K to 16-blocks when every offset is a multiple of 16 (each scale repeated)."""
        if dim != 1 or math.gcd(self.group_size, *offsets) < MIN_GROUP:
            raise MisalignedSliceError(
                f"Mxfp4Tensor: cutting {self._dim_text(dim)} (blocks of {self.group_size}) at "
                f"offsets {offsets} falls on no block of {MIN_GROUP} or more; cut at multiples "
                f"of {self.group_size}, or of {MIN_GROUP}"
            )
        return self.regroup(MIN_GROUP)

    def regroup(self, group_size: int) -> Mxfp4Tensor:
        """The same weight with finer blocks; each scale is repeated, exactly."""
        repeat, k = self.group_size // group_size, self.logical_shape[-1]
        scale = self.scale.repeat_interleave(repeat, -1)[..., : -(-k // group_size)]
        out = self.with_changes({"scale": scale}, group_size=group_size)
        out.write_barrier = (
            f"it shares its 4-bit data with a tensor of {self.group_size}-blocks but has its own "
            f"re-grouped {group_size}-block scales, so a copy would update only the data; copy "
            f"into the original at multiples of its blocks, or clone() this one first"
        )
        return out

    def matrix_max_magnitude(self) -> float:
        return E2M1_MAX * abs_max(self.scale)

    def dequantize_matrix(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        k = self.logical_shape[-1]
        weight = dequantize_mxfp4(self.qdata, self.scale, self.group_size, k, dtype or self.dtype)
        return weight.t() if self.transposed else weight

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        check_activation(self, x)
        if self.select_backend(x) is Backend.TRITON:
            load_w4a16_ops()
            return torch.ops.qshard.mxfp4_linear(x, self.qdata, self.scale, bias, self.group_size)
        if self.backend is Backend.REFERENCE:
            return mxfp4_linear_reference(x, self.qdata, self.scale, self.group_size, bias)
        # auto where no qshard kernel runs (the CPU): the reference's weight, the BLAS's sums.
        k = self.logical_shape[-1]
        weight = dequantize_mxfp4(self.qdata, self.scale, self.group_size, k, x.dtype)
        return linear_in_dtype(x, weight, bias)

    def grouped_linear(self, x, offs, bias=None):
        return weight_only_grouped_linear(self, x, offs, bias, "mxfp4", self.group_size)

    def select_backend(self, x: torch.Tensor) -> Backend:
        return weight_only_backend(self, x)
