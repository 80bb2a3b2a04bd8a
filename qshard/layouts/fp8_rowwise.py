"""FP8 per-row layout: e4m3 weights with one fp32 scale per output row (per channel).

The FP8 format of torchao's `PerRow()` Float8Tensor, compressed-tensors' `channel` strategy
(llm-compressor's FP8-Dynamic models) and FBGEMM's row-wise FP8; on Hopper it runs on the
row-wise scaled cuBLAS/CUTLASS GEMM (`torch._scaled_mm`), with activations quantized per token.

Inner tensors (logical weight [N, K]):
    qdata  float8_e4m3fn [N, K]   one weight per element, row-major
    scale  float32 [N, 1]         one multiplier per row: W[n, k] = qdata[n, k] * scale[n]
Attributes:
    weight_only  True: activations stay in their float dtype (W8A16); False: quantized per
                 token to e4m3 with an fp32 scale (W8A8, dynamic)
    backend      AUTO (cuBLAS where it runs: sm_90+, bf16, N and K multiples of 16; else the
                 reference), REFERENCE, or CUBLAS (forced; BackendUnavailableError elsewhere)

Packing for the shape ops: qdata (1, 1), scale (1, WHOLE): rows and columns slice anywhere; a
part of the columns keeps its rows' scales (a row-parallel TP shard), so `quantize_like` and
`from_float_part` quantize a part with the scales of the whole rows it belongs to. In W8A8 a
row-parallel shard quantizes its own slice of each token (`activation_scale_spans_k`), so its
all-reduced output is the sum of the parts' products, as in vLLM's and torchao's TP.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ..config import Backend, QuantConfig, ScaleFormat, parse_backend
from ..errors import BackendUnavailableError, ConfigError
from ..kernels.fp8_blockwise import E4M3_MAX, scales_from_amax
from ..kernels.fp8_rowwise import (
    cublas_rowwise_unavailable_reason,
    dequantize_rowwise,
    fp8_rowwise_linear_cublas,
    fp8_rowwise_linear_dequantized,
    fp8_rowwise_linear_reference,
    quantize_rows,
    row_amax,
    row_scales,
)
from ..qtensor import WHOLE, QTensor
from ..qtensor.registry import register_layout
from .checks import abs_max, check_activation, check_float_weight, checked_config, quantized

__all__ = ["FP8_ROWWISE_MIN_SQNR_DB", "Fp8RowwiseConfig", "Fp8RowwiseTensor"]

# F.linear vs float on Gaussian weights: e4m3's 3 mantissa bits give ~29 dB, as blockwise.
FP8_ROWWISE_MIN_SQNR_DB = 25.0
AVAILABLE_BACKENDS = (Backend.AUTO, Backend.REFERENCE, Backend.CUBLAS)


@dataclasses.dataclass(frozen=True)
class Fp8RowwiseConfig(QuantConfig):
    """FP8 e4m3 weights with one scale per output row; activations quantized per token."""

    weight_only: bool = False
    backend: Backend = Backend.AUTO

    def __post_init__(self):
        name = type(self).__name__
        if not isinstance(self.weight_only, bool):
            raise ConfigError(f"{name}: weight_only={self.weight_only!r} must be True or False")
        self._set("backend", parse_backend(self.backend, AVAILABLE_BACKENDS, name))


@register_layout(Fp8RowwiseConfig)
class Fp8RowwiseTensor(QTensor):
    """An FP8 e4m3 weight with per-row fp32 scales. See the module docstring."""

    inner_names = ("qdata", "scale")
    attr_names = ("weight_only", "backend")
    min_linear_sqnr_db: ClassVar[float] = FP8_ROWWISE_MIN_SQNR_DB

    qdata: torch.Tensor
    scale: torch.Tensor
    weight_only: bool
    backend: Backend

    @classmethod
    def quantize_matrix(
        cls,
        weight: torch.Tensor,
        config: Fp8RowwiseConfig | None = None,
        scale: torch.Tensor | None = None,
    ) -> Fp8RowwiseTensor:
        """Quantize `weight` with its own row scales, or with `scale` [N, 1] (its whole rows')."""
        config = checked_config(cls.__name__, Fp8RowwiseConfig, config)
        check_float_weight(cls.__name__, weight)
        weight = weight.detach()
        if scale is not None and tuple(scale.shape) != (weight.shape[0], 1):
            raise ConfigError(
                f"Fp8RowwiseTensor.from_float: scale {list(scale.shape)} for a weight "
                f"{list(weight.shape)}; the row scales are [{weight.shape[0]}, 1]"
            )
        scale = row_scales(weight) if scale is None else scale.to(weight.device, torch.float32)
        return quantized(
            cls(
                {"qdata": quantize_rows(weight, scale), "scale": scale.clone()},
                shape=tuple(weight.shape),
                dtype=weight.dtype,
                weight_only=config.weight_only,
                backend=config.backend,
            )
        )

    @classmethod
    def from_float_part(cls, part, whole, config) -> Fp8RowwiseTensor:
        """A rank's shard of a DTensor weight, scaled by the amax of its whole rows: a shard of
        the columns (row-parallel) reduces the amax over every rank's columns. Of a plain
        tensor, a part of whole rows (each row's scale is its own amax)."""
        from torch.distributed.tensor import (  # start-up time: DTensors only
            DTensor,
            Partial,
            Replicate,
        )

        if not isinstance(whole, DTensor):
            if part.shape[-1] != whole.shape[-1]:
                raise ConfigError(
                    f"Fp8RowwiseTensor.from_float_part: a part {list(part.shape)} of a plain "
                    f"{list(whole.shape)} tensor cuts its rows, whose scales need the whole "
                    f"rows' amax; pass whole rows, or the DTensor weight (its placements say "
                    f"which columns this part holds)"
                )
            return cls.from_float(part, config)

        amax = row_amax(whole)
        placements = [Replicate() if isinstance(p, Partial) else p for p in amax.placements]
        amax = amax.redistribute(placements=placements).to_local()
        return cls.from_float(part, config, scale=scales_from_amax(amax, ScaleFormat.FP32))

    def quantize_matrix_like(self, weight: torch.Tensor, at: tuple[int, int] = (0, 0)):
        rows = self.scale[at[0] : at[0] + weight.shape[0]]
        if rows.shape[0] != weight.shape[0]:
            raise ConfigError(
                f"Fp8RowwiseTensor.quantize_like: a part {list(weight.shape)} at {list(at)} is "
                f"not all in this {list(self.logical_shape)} weight; pass the part's offset `at`"
            )
        return type(self).from_float(weight, self.config(), scale=rows)

    @classmethod
    def contract_configs(cls) -> list[Fp8RowwiseConfig]:
        return [Fp8RowwiseConfig(), Fp8RowwiseConfig(weight_only=True)]

    def config(self) -> Fp8RowwiseConfig:
        return Fp8RowwiseConfig(**self.attrs())

    @classmethod
    def check_attrs(cls, attrs) -> None:
        Fp8RowwiseConfig(**attrs)  # every attribute is a config field, checked there

    # ---- hooks for the shared shape ops ---------------------------------------------------

    def packing(self) -> dict[str, tuple[int, int] | None]:
        return {"qdata": (1, 1), "scale": (1, WHOLE)}

    @classmethod
    def matrix_specs(cls, shape, attrs):
        n, k = shape
        return {"qdata": ((n, k), torch.float8_e4m3fn), "scale": ((n, 1), torch.float32)}

    def matrix_max_magnitude(self) -> float:
        return E4M3_MAX * abs_max(self.scale)

    def dequantize_matrix(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        weight = dequantize_rowwise(self.qdata, self.scale, dtype or self.dtype)
        return weight.t() if self.transposed else weight

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        check_activation(self, x)
        if self.select_backend(x) is Backend.CUBLAS:
            bias = bias.to(x.dtype) if bias is not None else None
            return fp8_rowwise_linear_cublas(x, self.qdata, self.scale, bias)
        # auto where no qshard kernel runs (the CPU): dequantize, then the BLAS.
        linear = (
            fp8_rowwise_linear_reference
            if self.backend is Backend.REFERENCE
            else fp8_rowwise_linear_dequantized
        )
        return linear(x, self.qdata, self.scale, weight_only=self.weight_only, bias=bias)

    def activation_scale_spans_k(self) -> bool:
        return not self.weight_only  # one scale per token over all of K

    def select_backend(self, x: torch.Tensor) -> Backend:
        """`auto`: cuBLAS where it can run (W8A8, see `_unavailable_reason`), else REFERENCE, which
        `_linear` runs as dequantize + BLAS unless the weight's backend is `reference` itself.
        A forced `cublas` that cannot run raises BackendUnavailableError."""
        if self.backend is Backend.REFERENCE:
            return Backend.REFERENCE
        reason = self._unavailable_reason(x)
        if self.backend is Backend.AUTO:
            return Backend.REFERENCE if reason else Backend.CUBLAS
        if reason:
            raise BackendUnavailableError(
                f"Fp8RowwiseTensor {list(self.logical_shape)}: backend 'cublas' cannot run "
                f"here: {reason}; use backend='auto' (which picks what runs) or 'reference'"
            )
        return Backend.CUBLAS

    def _unavailable_reason(self, x: torch.Tensor) -> str | None:
        if self.weight_only:
            return "weight-only (W8A16) FP8 runs on the reference path in this version"
        n, k = self.matrix_shape
        return cublas_rowwise_unavailable_reason(x.device, n, k, x.dtype)
