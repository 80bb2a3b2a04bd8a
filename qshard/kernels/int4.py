"""Int4 weight-only quantization and matmul: the reference definitions.

Weights [N, K] in groups of `group` consecutive channels along K (the last group may be
partial): W ~= (u - zero) * scale, u in 0..15 (4 bits), one (scale, zero) per row per group.
Asymmetric: over the group's range widened to include 0, scale = (max - min) / 15,
zero = clamp(round(-min / scale), 0, 15), u = clamp(round(w / scale) + zero, 0, 15).
Symmetric: scale = amax / 7.5, q = clamp(round(w / scale), -8, 7), stored as u = q + 8 with
zero = 8 for every group (not stored). Float zero point (torchao's Int4Tensor, HQQ, tinygemm):
W ~= (u - 8) * scale + zero, with zero a float (the value of code 8), over the group's own
range: scale = (max - min) / 15, zero = min + 8 * scale, u = clamp(round((w - zero) / scale) +
8, 0, 15); its dequantization rounds once ((u - 8) * scale + zero, exact in float64, then fp32:
what one FMA gives). Scales and zeros are bfloat16 (4.25 bits per weight at g128);
u is computed with the bf16-rounded scale (and zero), so that the stored values are the ones the
quantization used.

Packing: two weights per byte along K, the even index in the low nibble (the convention of
NVFP4, gpt-oss MXFP4 and compressed-tensors' LSB-first order, docs/design.md, "Formats"):
packed[n, j] = u[n, 2j] | (u[n, 2j + 1] << 4); an odd K leaves the last high nibble zero.
These plain-PyTorch functions run on any device and define what the kernels must compute.
"""

from __future__ import annotations

import torch

from .packing import (
    apply_groups,
    expand_groups,
    group_reduce,
    linear_float64,
    pack_nibbles,
    unpack_nibbles,
)

__all__ = [
    "SCALE_DTYPE",
    "dequantize_int4",
    "int4_linear_reference",
    "pack_nibbles",
    "quantize_int4",
    "unpack_nibbles",
]

SCALE_DTYPE = torch.bfloat16
SYMMETRIC_ZERO = 8.0


def quantize_int4(
    weight: torch.Tensor,
    group: int,
    symmetric: bool,
    float_zero: bool = False,
    params: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (packed uint8 [N, ceil(K/2)], scale bf16 [N, G], zero bf16 [N, G] or
    [0, 0] when symmetric), G = ceil(K/group). `float_zero`: zero is a float (see above).
    `params`: (scale, zero) to round with instead of the groups' own (a calibration's: GPTQ)."""
    w = weight.float()
    if params is not None:
        scale, zero = params
        return pack_nibbles(int4_codes(w, scale, zero, group, symmetric, float_zero)), scale, zero
    if float_zero:
        return _quantize_float_zero(w, group)
    if symmetric:
        amax = group_reduce(w.abs(), group, lambda t, d: t.amax(d))
        scale = amax / torch.full_like(amax, 7.5)
    else:
        # The range always includes 0, so the zero point is a code (0..15), exact in bf16.
        high = group_reduce(w, group, lambda t, d: t.amax(d)).clamp(min=0)
        low = group_reduce(w, group, lambda t, d: t.amin(d)).clamp(max=0)
        fifteen = torch.full_like(high, 15.0)
        scale = high / fifteen - low / fifteen  # not (high - low) / 15: that overflows near 3e38
    # In bf16 first: a tiny fp32 scale rounds to 0 there. An all-zero group gets scale 1.
    scale = scale.to(SCALE_DTYPE)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if symmetric:
        zero = torch.zeros(0, 0, dtype=SCALE_DTYPE, device=w.device)
    else:
        # 0 - low, not -low: a group with no negative value has low = 0 and -low = -0.0, and
        # clamp keeps a -0.0 zero point on the CPU but not on CUDA (other bytes, same value).
        zero = torch.clamp(torch.round((0.0 - low) / scale.float()), 0, 15).to(SCALE_DTYPE)
    return pack_nibbles(int4_codes(w, scale, zero, group, symmetric, False)), scale, zero


def int4_codes(
    w: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group: int,
    symmetric: bool,
    float_zero: bool,
) -> torch.Tensor:
    """fp32 [N, K] -> its codes u (uint8 0..15) under the groups' scale and zero, rounded to
    nearest (ties to even) and clamped."""
    k = w.shape[1]
    full_scale = expand_groups(scale.float(), group, k)
    if symmetric:
        q = torch.clamp(torch.round(w / full_scale), -8, 7) + SYMMETRIC_ZERO
    elif float_zero:
        full_zero = expand_groups(zero.float(), group, k)
        q = torch.clamp(torch.round((w - full_zero) / full_scale) + SYMMETRIC_ZERO, 0, 15)
    else:
        q = torch.clamp(torch.round(w / full_scale) + expand_groups(zero.float(), group, k), 0, 15)
    return q.to(torch.uint8)


def _quantize_float_zero(w: torch.Tensor, group: int):
    high = group_reduce(w, group, lambda t, d: t.amax(d))
    low = group_reduce(w, group, lambda t, d: t.amin(d))
    fifteen = torch.full_like(high, 15.0)
    scale = (high / fifteen - low / fifteen).to(SCALE_DTYPE)
    # A constant group (or one whose range rounds to 0 in bf16): a step of |value| / 15, so
    # the group's value is code 0 exactly up to bf16; an all-zero group: scale 1.
    fallback = (torch.maximum(high.abs(), low.abs()) / fifteen).to(SCALE_DTYPE)
    scale = torch.where(scale > 0, scale, torch.where(fallback > 0, fallback, 1.0))
    zero = (low + 8.0 * scale.float()).to(SCALE_DTYPE)
    return pack_nibbles(int4_codes(w, scale, zero, group, False, True)), scale, zero


def dequantize_int4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group: int,
    k: int,
    dtype: torch.dtype,
    float_zero: bool = False,
) -> torch.Tensor:
    """(u - zero) * scale in fp32, rounded once to `dtype`; zero = 8 when `zero` is empty.
    `float_zero`: (u - 8) * scale + zero, rounded once to fp32 (an FMA), then to `dtype`: the
    product has at most 12 significant bits (4 of the code, 8 of the bf16 scale), so it is
    exact in fp32 and the sum is the one rounding. In place on the fresh fp32 codes (packing.py's
    `apply_groups`)."""
    w = unpack_nibbles(packed, k).float()
    if float_zero:
        apply_groups(w.sub_(SYMMETRIC_ZERO), scale.float(), group, torch.Tensor.mul_)
        return apply_groups(w, zero.float(), group, torch.Tensor.add_).to(dtype)
    if zero.numel():
        apply_groups(w, zero.float(), group, torch.Tensor.sub_)
    else:
        w.sub_(SYMMETRIC_ZERO)
    return apply_groups(w, scale.float(), group, torch.Tensor.mul_).to(dtype)


def int4_linear_reference(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group: int,
    bias: torch.Tensor | None = None,
    float_zero: bool = False,
) -> torch.Tensor:
    """y = x @ W.T + bias with W dequantized to x's dtype (what a W4A16 kernel multiplies),
    accumulated in float64 and rounded once: exact enough that the result does not depend on
    BLAS blocking, so column-parallel shards equal the single-device output bit for bit."""
    weight = dequantize_int4(packed, scale, zero, group, x.shape[-1], x.dtype, float_zero)
    return linear_float64(x, weight, bias)
