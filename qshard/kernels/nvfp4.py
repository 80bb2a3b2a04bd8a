"""NVFP4 weight-only quantization and matmul: the reference definitions (NVIDIA's NVFP4, as
ModelOpt writes it; docs/design.md, "Formats").

W ~= e2m1 * block_scale * global_scale:
- e2m1 codes as MXFP4 (`mxfp4.py`: grid 0, 0.5, 1, 1.5, 2, 3, 4, 6, sign in bit 3, round to
  nearest even, saturating), two per byte along K, the even index in the low nibble.
- block_scale: float8_e4m3fn per 16 values along K (the last block may be partial),
  RN(amax_block / 6 / global_scale) clamped to 448; an all-zero block gets 1.0, and a non-zero
  block whose scale rounds to 0 gets e4m3's smallest step (2**-9) so its values stay finite.
- global_scale: one fp32 multiplier per tensor ([1, 1]), amax(|W|) / (6 * 448) (ModelOpt's
  `weight_scale_2`), so that every block scale fits e4m3; 1.0 for an all-zero weight. A part of
  a weight (a TP shard) is quantized with the whole weight's global scale.
- Dequantization in fp32, in this order: (e2m1 * block_scale) * global_scale (the first product
  is exact), then rounded once to the output dtype.
"""

from __future__ import annotations

import torch

from .mxfp4 import E2M1_MAX, e2m1_codes, e2m1_values
from .packing import apply_groups, expand_groups, group_reduce, linear_float64, pack_nibbles

__all__ = [
    "GROUP",
    "dequantize_nvfp4",
    "global_scale_of",
    "nvfp4_linear_reference",
    "quantize_nvfp4",
]

GROUP = 16
E4M3_MAX = 448.0
E4M3_MIN_STEP = 2.0**-9
SCALE_DTYPE = torch.float8_e4m3fn


def global_scale_of(weight: torch.Tensor) -> torch.Tensor:
    """amax(|W|) / (6 * 448) in fp32, as a [1, 1] tensor; 1.0 if that is 0. For a DTensor
    weight, the amax of the whole tensor (DTensor reduces it over the shards)."""
    # An empty weight (a [0, K] shard, issue 21) has no amax: its scale is 1.0, like a zero one.
    weight = weight.detach()
    amax = weight.abs().amax() if weight.numel() else weight.new_zeros(())
    if hasattr(amax, "full_tensor"):  # a DTensor: a max all-reduce over the mesh
        amax = amax.full_tensor()
    # A tensor divisor, not a Python scalar: CUDA multiplies by the reciprocal of a scalar
    # divisor (one ulp off for some amax), and a weight must get the same global scale on
    # every device (tests/test_cuda.py; issue 21 saw 2 runs in 5 differ on an H100).
    amax = amax.float()
    scale = amax / torch.full_like(amax, E2M1_MAX * E4M3_MAX)
    return torch.where(scale > 0, scale, torch.ones_like(scale)).reshape(1, 1)


def quantize_nvfp4(
    weight: torch.Tensor,
    global_scale: torch.Tensor,
    group: int = GROUP,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (packed uint8 [N, ceil(K/2)], block scales e4m3 [N, ceil(K/group)]).
    `scale`: e4m3 block scales to round with instead of the blocks' own (a calibration's)."""
    w = weight.float()
    k = w.shape[1]
    global_scale = global_scale.float()
    if scale is None:
        amax = group_reduce(w.abs(), group, lambda t, d: t.amax(d))
        six = amax.new_full((), E2M1_MAX)  # a tensor divisor, not a scalar: see global_scale_of
        block = (amax / six / global_scale).clamp(max=E4M3_MAX).to(SCALE_DTYPE).float()
        block = torch.where(amax > 0, block.clamp(min=E4M3_MIN_STEP), torch.ones_like(block))
        scale = block.to(SCALE_DTYPE)
    divisor = expand_groups(scale.float() * global_scale, group, k)
    v = (w / divisor).clamp(-E2M1_MAX, E2M1_MAX)
    return pack_nibbles(e2m1_codes(v)), scale


def dequantize_nvfp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    group: int,
    k: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    values = apply_groups(e2m1_values(packed, k), scale.float(), group, torch.Tensor.mul_)
    return values.mul_(global_scale).to(dtype)


def nvfp4_linear_reference(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    group: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ W.T + bias, W dequantized to x's dtype, accumulated in float64 (packing.py)."""
    weight = dequantize_nvfp4(packed, scale, global_scale, group, x.shape[-1], x.dtype)
    return linear_float64(x, weight, bias)
