"""FP8 per-row ("per-channel") quantization and matmul: the reference and the cuBLAS path.

Weights: float8_e4m3fn [N, K] with one fp32 multiplier per output row, scale [N, 1]: W = fp8 * scale
(torchao's PerRow Float8Tensor, compressed-tensors' `channel` strategy, FBGEMM's rowwise FP8;
docs/design.md, "Formats"). Activations (W8A8): quantized on the fly per token, one fp32 scale per
row of x, x ~= xq * x_scale. The scale of a row (token) is amax / 448, 1.0 for an all-zero row, as
in the blockwise layout (`scales_from_amax`).

The cuBLAS path is `torch._scaled_mm` with row-wise scales (scale_a [M, 1], scale_b [1, N]), the
kernel torchao's per-row config runs on Hopper; the activation quantization is plain torch ops,
so torch.compile fuses it into one kernel. Everything here is traceable by torch.compile.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ScaleFormat
from .fp8_blockwise import (
    E4M3_MAX,
    FP8,
    e4m3_to_float32,
    e4m3_to_float64,
    e4m3_weight_values,
    scales_from_amax,
)
from .packing import linear_in_dtype

__all__ = [
    "cublas_rowwise_unavailable_reason",
    "dequantize_rowwise",
    "fp8_rowwise_linear_cublas",
    "fp8_rowwise_linear_dequantized",
    "fp8_rowwise_linear_reference",
    "quantize_rows",
    "row_amax",
    "row_scales",
]


def row_amax(weight: torch.Tensor) -> torch.Tensor:
    """fp32 [N, 1]: the largest |value| of each row (0 for rows of no columns)."""
    if not weight.shape[1]:
        return torch.zeros(weight.shape[0], 1, device=weight.device)
    # |x| and its max are exact in the input's dtype: widen the [N, 1] result, not the input
    # (eager, a full fp32 copy of the activations was two more passes over them).
    return weight.detach().abs().amax(dim=1, keepdim=True).float()


def row_scales(weight: torch.Tensor) -> torch.Tensor:
    """fp32 [N, 1] multipliers mapping each row's [-amax, amax] onto e4m3's [-448, 448]."""
    return scales_from_amax(row_amax(weight), ScaleFormat.FP32)


def quantize_rows(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """values [R, K] / scale [R, 1] rounded to e4m3 (to nearest even), saturating at +-448."""
    # bf16 / fp32 promotes to fp32 in one pass: the same values as widening first.
    return torch.div(values, scale).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8)


def dequantize_rowwise(qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
    """fp8 * row scale in fp32, rounded once to `dtype`."""
    return e4m3_weight_values(qdata).mul_(scale).to(dtype)


def fp8_rowwise_linear_dequantized(
    x: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    *,
    weight_only: bool,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference's result by dequantize-and-matmul (`backend="auto"` where no qshard kernel
    runs, the CPU): W8A8 quantizes x per token exactly as the reference does and multiplies the
    dequantized fp32 operands in one BLAS call (within fp32 rounding of the reference's exact
    sums); weight-only multiplies W dequantized to x's dtype in x's dtype."""
    if weight_only:
        return linear_in_dtype(x, dequantize_rowwise(qdata, scale, x.dtype), bias)
    n, k = qdata.shape
    x2d = x.reshape(-1, k) if k else x.reshape(x.shape[:-1].numel(), 0)
    x_scale = row_scales(x2d)
    x_values = e4m3_to_float32(quantize_rows(x2d, x_scale)).mul_(x_scale)
    weight = dequantize_rowwise(qdata, scale, torch.float32)
    out = F.linear(x_values, weight, bias.float() if bias is not None else None)
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def fp8_rowwise_linear_reference(
    x: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    *,
    weight_only: bool,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ W.T + bias as the kernels compute it.

    W8A8: x quantized per token; the fp8 x fp8 products summed in float64 (each product is
    exact there, and the sum of K of them is within a few float64 ulps: far below the fp32 a
    kernel accumulates in), rounded to fp32, times x_scale * w_scale, plus bias in fp32, cast to
    x's dtype. Weight-only (W8A16): W dequantized to x's dtype and multiplied as in a bf16/fp16
    MMA, accumulated in float64, rounded once.
    """
    n, k = qdata.shape
    x2d = x.reshape(-1, k) if k else x.reshape(x.shape[:-1].numel(), 0)
    if weight_only:
        weight = dequantize_rowwise(qdata, scale, x.dtype)
        out = x2d.double() @ weight.double().t()
        if bias is not None:
            out = out + bias.to(x.dtype).double()
        return out.to(x.dtype).reshape(*x.shape[:-1], n)
    x_scale = row_scales(x2d)
    xq = quantize_rows(x2d, x_scale)
    products = (e4m3_to_float64(xq) @ e4m3_to_float64(qdata).t()).float()
    out = products * (x_scale * scale.t())
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def cublas_rowwise_unavailable_reason(
    device: torch.device, n: int, k: int, dtype: torch.dtype
) -> str | None:
    """Why `torch._scaled_mm` with row-wise scales cannot run this weight here, or None."""
    if device.type != "cuda":
        return f"it needs a CUDA device, not {device.type}"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return "cuBLAS/CUTLASS row-wise FP8 (torch._scaled_mm) runs on sm_90 or newer"
    if dtype is not torch.bfloat16:
        return f"torch._scaled_mm with row-wise scales writes bfloat16 only, not {dtype}"
    if n % 16 or k % 16:
        return f"torch._scaled_mm needs N and K multiples of 16, got N={n}, K={k}"
    return None


def fp8_rowwise_linear_cublas(
    x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """W8A8 per-row on Hopper: x quantized per token (plain ops, fused by torch.compile), then
    `torch._scaled_mm` (fp32 accumulation, both scales applied in its epilogue)."""
    n, k = qdata.shape
    x2d = x.reshape(-1, k)
    x_scale = row_scales(x2d)
    xq = quantize_rows(x2d, x_scale)
    out = torch._scaled_mm(
        xq, qdata.t(), scale_a=x_scale, scale_b=scale.t(), bias=bias, out_dtype=x.dtype
    )
    return out.reshape(*x.shape[:-1], n)
