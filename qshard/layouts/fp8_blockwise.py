"""FP8 blockwise layout (DeepSeek-V3: 128x128 weight blocks, 1x128 dynamic activation groups).

Inner tensors (logical weight [N, K]):
    qdata  float8_e4m3fn [N, K]                        one weight per element, row-major
    scale  float32 [ceil(N/bn), ceil(K/bk)]           one multiplier per (bn x bk) block:
                                                       W[n, k] = qdata[n, k] * scale[n//bn, k//bk];
                                                       edge blocks may be partial
Attributes:
    block_size      (bn, bk), powers of two >= 16 (128x128 by default)
    act_group_size  activations are quantized per token per this many channels; divides bk
    weight_only     True: activations stay in their float dtype (W8A16)
    scale_format    ScaleFormat.FP32, or UE8M0 (scales rounded up to powers of two)
    backend         AUTO (GPU kernels where they run, else dequantize + BLAS), REFERENCE, TRITON
                    or CUBLAS (forced; BackendUnavailableError where they cannot run)

Packing for the shape ops: qdata (1, 1), scale (bn, bk). A slice whose offsets are not multiples
of the block but are multiples of a finer power-of-two block (>= 16) re-blocks exactly: each
parent scale is repeated over the finer blocks it covers, so `dequantize()` is unchanged
(docs/design.md, "Tensor parallelism and blocks": a TP-32 shard of DeepSeek's 18432 columns is 576
= 4.5 x 128 -> 64x64 blocks).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch

from ..config import Backend, QuantConfig, ScaleFormat, as_int, parse_backend, parse_enum
from ..errors import (
    BackendUnavailableError,
    ConfigError,
    MisalignedSliceError,
)
from ..kernels.availability import cublas_unavailable_reason, triton_unavailable_reason
from ..kernels.fp8_blockwise import (
    E4M3_MAX,
    dequantize_blockwise,
    fp8_blockwise_linear_dequantized,
    fp8_blockwise_linear_reference,
    quantize_weight_blockwise,
)
from ..kernels.loader import load_gpu_ops, load_grouped_ops
from ..qtensor import QTensor
from ..qtensor.registry import register_layout
from .checks import abs_max, check_activation, check_float_weight, checked_config, quantized

__all__ = ["FP8_MIN_SQNR_DB", "MAX_BLOCK", "MIN_BLOCK", "Fp8BlockwiseConfig", "Fp8BlockwiseTensor"]

MIN_BLOCK = 16  # smallest block side: the K tile of an fp8 MMA instruction is 32, of tl.dot 16
# Largest block side: far above any model's (DeepSeek-V3: 128), and a bound on the sizes a
# checkpoint may declare (a side of 2**100 would overflow the index arithmetic; issue 21).
MAX_BLOCK = 2**16
FP8_MIN_SQNR_DB = 25.0  # F.linear vs float on Gaussian weights; e4m3's 3 mantissa bits give ~29
AVAILABLE_BACKENDS = (Backend.AUTO, Backend.REFERENCE, Backend.TRITON, Backend.CUBLAS)


def _is_block_side(n: Any) -> bool:
    integer = isinstance(n, int) and not isinstance(n, bool)
    return integer and MIN_BLOCK <= n <= MAX_BLOCK and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class Fp8BlockwiseConfig(QuantConfig):
    """FP8 e4m3 weights with one scale per block; activations quantized per token per group."""

    block_size: tuple[int, int] = (128, 128)
    act_group_size: int | None = None  # None: the block's K side (128 for 128x128 blocks)
    weight_only: bool = False
    scale_format: ScaleFormat = ScaleFormat.FP32
    backend: Backend = Backend.AUTO

    def __post_init__(self):
        name = type(self).__name__
        block = (
            tuple(map(as_int, self.block_size)) if isinstance(self.block_size, list | tuple) else ()
        )
        if len(block) != 2 or not all(_is_block_side(b) for b in block):
            raise ConfigError(
                f"{name}: block_size={self.block_size!r}; each side must be a power of two in "
                f"{MIN_BLOCK}..{MAX_BLOCK}, e.g. (128, 128) (DeepSeek-V3) or (64, 64)"
            )
        self._set("block_size", block)
        group = block[1] if self.act_group_size is None else as_int(self.act_group_size)
        if not _is_block_side(group) or block[1] % group:
            raise ConfigError(
                f"{name}: act_group_size={group!r} must be a power of two >= {MIN_BLOCK} that "
                f"divides the block's K side {block[1]} (each activation group must meet one "
                f"weight scale); use act_group_size={block[1]}"
            )
        self._set("act_group_size", group)
        if not isinstance(self.weight_only, bool):
            raise ConfigError(f"{name}: weight_only={self.weight_only!r} must be True or False")
        self._set("scale_format", parse_enum(ScaleFormat, self.scale_format, "scale_format", name))
        self._set("backend", parse_backend(self.backend, AVAILABLE_BACKENDS, name))


@register_layout(Fp8BlockwiseConfig)
class Fp8BlockwiseTensor(QTensor):
    """An FP8 e4m3 weight with per-block fp32 scales. See the module docstring for the packing."""

    inner_names = ("qdata", "scale")
    attr_names = ("block_size", "act_group_size", "weight_only", "scale_format", "backend")
    min_linear_sqnr_db: ClassVar[float] = FP8_MIN_SQNR_DB

    qdata: torch.Tensor
    scale: torch.Tensor
    block_size: tuple[int, int]
    act_group_size: int
    weight_only: bool
    scale_format: ScaleFormat
    backend: Backend

    # ---- construction ---------------------------------------------------------------------

    @classmethod
    def quantize_matrix(
        cls, weight: torch.Tensor, config: Fp8BlockwiseConfig | None = None
    ) -> Fp8BlockwiseTensor:
        config = checked_config(cls.__name__, Fp8BlockwiseConfig, config)
        check_float_weight(cls.__name__, weight)
        weight = weight.detach()  # a quantized weight is a leaf: keep no autograd history
        qdata, scale = quantize_weight_blockwise(weight, config.block_size, config.scale_format)
        return quantized(
            cls(
                {"qdata": qdata, "scale": scale},
                shape=tuple(weight.shape),
                dtype=weight.dtype,
                block_size=config.block_size,
                act_group_size=config.act_group_size,
                weight_only=config.weight_only,
                scale_format=config.scale_format,
                backend=config.backend,
            )
        )

    @classmethod
    def contract_configs(cls) -> list[Fp8BlockwiseConfig]:
        """Configs the layout contract suite runs over."""
        return [
            Fp8BlockwiseConfig(),
            Fp8BlockwiseConfig(block_size=(64, 32), act_group_size=32, scale_format="ue8m0"),
            Fp8BlockwiseConfig(block_size=(32, 64), weight_only=True),
        ]

    def config(self) -> Fp8BlockwiseConfig:
        return Fp8BlockwiseConfig(**self.attrs())

    @classmethod
    def check_attrs(cls, attrs) -> None:
        Fp8BlockwiseConfig(**attrs)  # every attribute is a config field, checked there

    # ---- hooks for the shared shape ops ---------------------------------------------------

    def packing(self) -> dict[str, tuple[int, int] | None]:
        return {"qdata": (1, 1), "scale": self.block_size}

    @classmethod
    def matrix_specs(cls, shape, attrs):
        (n, k), (bn, bk) = shape, attrs["block_size"]
        return {
            "qdata": ((n, k), torch.float8_e4m3fn),
            "scale": ((-(-n // bn), -(-k // bk)), torch.float32),
        }

    def _realign_misaligned(self, dim: int, offsets: list[int]) -> Fp8BlockwiseTensor:
        """Re-block `dim` to the largest power-of-two block that divides every offset."""
        block = self.block_size[dim]
        finer = math.gcd(block, *offsets)
        if finer < MIN_BLOCK:
            raise MisalignedSliceError(
                f"Fp8BlockwiseTensor: cutting {self._dim_text(dim)} (blocks of {block}) at "
                f"offsets {offsets} falls on no block of {MIN_BLOCK} or more; cut at multiples "
                f"of {block} to keep the blocks, or at multiples of a power of two >= "
                f"{MIN_BLOCK} dividing {block} to re-block exactly"
            )
        block_size = list(self.block_size)
        block_size[dim] = finer
        return self.reblock(tuple(block_size))

    # ---- layout-specific API --------------------------------------------------------------

    def reblock(self, block_size: tuple[int, int]) -> Fp8BlockwiseTensor:
        """The same weight with finer blocks; each scale is repeated, dequantize() is unchanged.

        Activation groups shrink to fit the new K block (a 128-group meets two 64-blocks).
        """
        pbn, pbk = self.block_size
        pair = isinstance(block_size, list | tuple) and len(block_size) == 2
        bn, bk = block_size if pair else (0, 0)
        if not (_is_block_side(bn) and _is_block_side(bk) and pbn % bn == 0 and pbk % bk == 0):
            raise ConfigError(
                f"Fp8BlockwiseTensor.reblock({block_size}): a finer block must divide the "
                f"current {self.block_size} and be a power of two >= {MIN_BLOCK}"
            )
        n, k = self.matrix_shape
        scale = self.scale.repeat_interleave(pbn // bn, -2)[..., : -(-n // bn), :]
        scale = scale.repeat_interleave(pbk // bk, -1)[..., : -(-k // bk)]
        out = self.with_changes(
            {"scale": scale},
            block_size=(bn, bk),
            act_group_size=math.gcd(self.act_group_size, bk),
        )
        if (bn, bk) != self.block_size:
            out.write_barrier = (
                f"it shares its fp8 data with a tensor of {self.block_size} blocks but has its "
                f"own re-blocked {(bn, bk)} scales, so a copy would update only the data; copy "
                f"into the original at multiples of its blocks, or clone() this one first"
            )
        return out

    def matrix_max_magnitude(self) -> float:
        return E4M3_MAX * abs_max(self.scale)

    def matrix_value_problem(self) -> str | None:
        if self.scale_format is ScaleFormat.UE8M0 and self.scale.numel():
            mantissa = torch.frexp(self.scale).mantissa.abs()
            if not bool((mantissa == 0.5).all()):
                return "scale_format 'ue8m0' but not every scale is a power of two"
        return None

    def dequantize_matrix(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        weight = dequantize_blockwise(self.qdata, self.scale, self.block_size, dtype or self.dtype)
        return weight.t() if self.transposed else weight

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        check_activation(self, x)
        backend = self.select_backend(x)
        if backend is not Backend.REFERENCE:
            load_gpu_ops()
            (bn, bk), ue8m0 = self.block_size, self.scale_format is ScaleFormat.UE8M0
            return torch.ops.qshard.fp8_blockwise_linear(
                x,
                self.qdata,
                self.scale,
                bias,
                bn,
                bk,
                self.act_group_size,
                ue8m0,
                backend.value,
            )
        # auto where no qshard kernel runs (the CPU): dequantize, then the BLAS.
        linear = (
            fp8_blockwise_linear_reference
            if self.backend is Backend.REFERENCE
            else fp8_blockwise_linear_dequantized
        )
        return linear(
            x,
            self.qdata,
            self.scale,
            block_size=self.block_size,
            act_group_size=self.act_group_size,
            scale_format=self.scale_format,
            weight_only=self.weight_only,
            bias=bias,
        )

    def grouped_linear(self, x, offs, bias=None):
        """Experts: the fused grouped kernel (kernels/grouped/) where the Triton
        kernels run, else each expert's reference (QTensor.grouped_linear)."""
        check_activation(self, x)
        if self.backend is Backend.CUBLAS:
            raise BackendUnavailableError(
                "Fp8BlockwiseTensor experts: cuBLAS has no grouped blockwise FP8 matmul; use "
                "backend='auto' or 'triton' (qshard's grouped kernel)"
            )
        if self.select_backend(x) is Backend.REFERENCE:
            return super().grouped_linear(x, offs, bias)
        load_grouped_ops()
        (bn, bk), ue8m0 = self.block_size, self.scale_format is ScaleFormat.UE8M0
        return torch.ops.qshard.fp8_blockwise_grouped_linear(
            x, offs, self.qdata, self.scale, bias, bn, bk, self.act_group_size, ue8m0
        )

    def select_backend(self, x: torch.Tensor) -> Backend:
        """Which implementation runs `x @ W.T`.

        `auto`: the GPU kernels where they can run (W8A8 on a CUDA GPU with Triton, sm_89+),
        else the reference; between Triton and cuBLAS the op itself picks by the number of
        tokens at run time (kernels/fp8/select.py). A forced `triton` or `cublas` that
        cannot run here raises BackendUnavailableError; nothing is substituted silently.
        """
        if self.backend is Backend.REFERENCE:
            return Backend.REFERENCE
        reason = self._unavailable_reason(x.device, self.backend)
        if self.backend is Backend.AUTO:
            interpreted = x.device.type == "cpu"  # the Triton interpreter: for tests only
            return Backend.REFERENCE if reason or interpreted else Backend.AUTO
        if reason:
            raise BackendUnavailableError(
                f"Fp8BlockwiseTensor {list(self.logical_shape)}: backend "
                f"{self.backend.value!r} cannot run here: {reason}; use backend='auto' (which "
                f"picks what runs) or 'reference'"
            )
        return self.backend

    def _unavailable_reason(self, device: torch.device, backend: Backend) -> str | None:
        if self.weight_only:
            return "weight-only (W8A16) FP8 runs on the reference path in this version"
        if self.act_group_size < 32:  # one group is one K step of the fp8 MMA (K = 32)
            group = self.act_group_size
            return f"the FP8 kernels take activation groups of 32 or more, not {group}"
        if backend is Backend.CUBLAS:
            n, k = self.matrix_shape
            return cublas_unavailable_reason(device, n, k, *self.block_size, self.act_group_size)
        return triton_unavailable_reason(device)
