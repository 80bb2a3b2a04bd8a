"""FP8 blockwise (DeepSeek-V3 style) quantization and matmul: the reference definitions.

Weights: float8_e4m3fn [N, K] with one fp32 scale per (bn x bk) block, scale shape
[ceil(N/bn), ceil(K/bk)], partial edge blocks allowed; the scale is a multiplier,
W = fp8 * scale (DeepSeek's `weight_scale_inv` convention, docs/design.md, "Formats").
Activations: quantized on the fly per token per `group` channels (1x128 in DeepSeek-V3, 1x64
after re-blocking), scales [M, ceil(K/group)].

These plain-PyTorch functions run on any device and are the definition that the fast kernels
(Triton, cuBLAS) must reproduce. They are traceable by torch.compile.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ScaleFormat
from .packing import apply_groups, linear_float64, linear_in_dtype

__all__ = [
    "E4M3_MAX",
    "dequantize_blockwise",
    "e4m3_to_float32",
    "e4m3_weight_values",
    "expand_block_scales",
    "fp8_blockwise_linear_dequantized",
    "fp8_blockwise_linear_reference",
    "quantize_activation_groups",
    "quantize_weight_blockwise",
]

E4M3_MAX = 448.0  # largest finite float8_e4m3fn (OCP FP8 spec)
FP8 = torch.float8_e4m3fn


def round_up_to_power_of_two(scale: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= scale, for positive fp32 scales (UE8M0, DeepSeek `scale_fmt`).

    Done on the bits, not with log2: log2 rounds values just above a power of two down to it.
    """
    bits = scale.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    has_mantissa = (bits & 0x7FFFFF) != 0
    return ((exponent + has_mantissa.to(torch.int32)) << 23).view(torch.float32)


def scales_from_amax(amax: torch.Tensor, scale_format: ScaleFormat) -> torch.Tensor:
    """fp32 multipliers that map [-amax, amax] onto the e4m3 range.

    An all-zero block (or one so tiny that amax / 448 underflows) gets scale 1.0: any positive
    scale is exact for zeros, and 1.0 cannot make a NaN or a denormal later.
    """
    amax = amax.float()
    # A tensor divisor, not a Python scalar: CUDA multiplies by the reciprocal of a scalar
    # divisor (1 ulp off), and weights must quantize to the same bits on every device.
    scale = amax / torch.full_like(amax, E4M3_MAX)
    # amax below ~6e-43 underflows to a zero scale: treat it as an all-zero block.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if scale_format is ScaleFormat.UE8M0:
        scale = round_up_to_power_of_two(scale)
    return scale


def e4m3_to_float64(q: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> float64, exactly: a lookup in the 256 decoded codes.

    Not a cast: inductor fuses fp8 -> fp32 -> fp64 into one fp8 -> fp64 cast, which Triton 3.6
    cannot compile for sm_90. (The lookup is one gather; decoding every element from its bits
    costs four times as much on CPU.)
    """
    codes = torch.arange(256, dtype=torch.uint8, device=q.device)
    return _decode_e4m3_bits(codes)[q.view(torch.uint8).to(torch.int32)]


def e4m3_weight_values(q: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn codes of a weight -> a fresh float32 tensor, exactly, for codes already
    checked finite (every reader and `from_float` do, docs/design.md invariant 9; a NaN code would
    decode as +-480).

    Eager, by bits: each code shifted into an fp16's sign / exponent / mantissa is its value
    times 2**-8 (normal and subnormal alike), fp16 -> fp32 is a vectorized cast, and * 2**8 is
    exact: 0.9 ms for 2816 x 1024 on the 2-core CPU, against 1.5 ms for a lookup and 5.2 ms for
    torch's cast (docs/cpu.md). Compiled, and off the CPU, the cast (inductor vectorizes it; on
    an H100 the cast is 3x faster than the bit route)."""
    if torch.compiler.is_compiling() or q.device.type != "cpu":
        return q.float()
    bits = q.view(torch.int8).to(torch.int16)  # sign-extended
    bits <<= 7  # s eeee mmm -> fp16 bits 14..7 (bit 14 is then a copy of the sign)
    bits &= ~0x4000  # clear bit 14: the top fp16 exponent bit, always 0 for e4m3
    return bits.view(torch.float16).float().mul_(256.0)


def e4m3_to_float32(q: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> a fresh float32 tensor, exactly. Eager, a lookup in the 256 decoded
    codes: torch's CPU cast decodes element by element (5.2 ms for 2816 x 1024, the lookup
    1.8 ms; docs/cpu.md). Compiled, the cast, which inductor vectorizes."""
    if torch.compiler.is_compiling() or q.device.type != "cpu":
        return q.float()
    codes = torch.arange(256, dtype=torch.uint8, device=q.device)
    table = _decode_e4m3_bits(codes).float()
    return table.index_select(0, q.view(torch.uint8).reshape(-1).int()).view(q.shape)


def _decode_e4m3_bits(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3 codes -> float64 with integer ops. e4m3 (OCP FP8): sign bit, 4 exponent bits
    (bias 7), 3 mantissa bits; normal (8 + m) * 2**(e - 10), subnormal (e == 0) m * 2**-9,
    NaN at S.1111.111."""
    bits = codes.to(torch.int64)
    exponent = (bits >> 3) & 0xF
    mantissa = (bits & 0x7).to(torch.float64)
    # 2**(max(e, 1) - 10), built from float64 bits (exponent bias 1023).
    power = ((exponent.clamp(min=1) - 10 + 1023) << 52).view(torch.float64)
    magnitude = torch.where(exponent == 0, mantissa, mantissa + 8) * power
    value = torch.where((bits & 0x80) != 0, -magnitude, magnitude)
    return torch.where((bits & 0x7F) == 0x7F, torch.full_like(value, float("nan")), value)


def _to_e4m3(values: torch.Tensor) -> torch.Tensor:
    # Saturate instead of overflowing: float8_e4m3fn has no Inf and casts overflow to NaN.
    return values.clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def group_index(size: int, group: int, device: torch.device) -> torch.Tensor:
    """[size] int64: the group (block) each of `size` consecutive elements belongs to."""
    return torch.arange(size, device=device) // group


def expand_block_scales(
    scale: torch.Tensor, block_size: tuple[int, int], shape: tuple[int, int]
) -> torch.Tensor:
    """Repeat each block scale over its block: [ceil(N/bn), ceil(K/bk)] -> [N, K].

    Indexing, not `repeat_interleave(...)[:n]`: inductor's CPU codegen (torch 2.13) gives
    wrong values for the latter when the scales are computed in the same graph.
    """
    rows = group_index(shape[0], block_size[0], scale.device)
    cols = group_index(shape[1], block_size[1], scale.device)
    return scale[rows[:, None], cols[None, :]]


def _block_amax(weight: torch.Tensor, block_size: tuple[int, int]) -> torch.Tensor:
    bn, bk = block_size
    n, k = weight.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = F.pad(weight.float().abs(), (0, kb * bk - k, 0, nb * bn - n))  # zeros leave amax
    return padded.view(nb, bn, kb, bk).amax(dim=(1, 3))


def quantize_weight_blockwise(
    weight: torch.Tensor, block_size: tuple[int, int], scale_format: ScaleFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (float8_e4m3fn [N, K], fp32 scales [ceil(N/bn), ceil(K/bk)])."""
    scale = scales_from_amax(_block_amax(weight, block_size), scale_format)
    full_scale = expand_block_scales(scale, block_size, tuple(weight.shape))
    return _to_e4m3(weight.float() / full_scale), scale


def dequantize_blockwise(
    qdata: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """fp8 * block scale in fp32, rounded once to `dtype`. Eager, in place on the fresh fp32
    values and by broadcasting where the blocks tile the weight (the same products)."""
    (n, k), (bn, bk) = qdata.shape, block_size
    values = e4m3_weight_values(qdata)
    if torch.compiler.is_compiling() or n % bn or k % bk or not values.is_contiguous():
        return (values * expand_block_scales(scale, block_size, (n, k))).to(dtype)
    values.view(n // bn, bn, k // bk, bk).mul_(scale[:, None, :, None])
    return values.to(dtype)


def quantize_activation_groups(
    x: torch.Tensor, group: int, scale_format: ScaleFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] float -> (float8_e4m3fn [M, K], fp32 scales [M, ceil(K/group)]), per token.

    The last group may be partial. Scales are multipliers: x ~= q * scale.
    """
    m, k = x.shape
    x = x.float()
    # Scales are statistics of x, not functions to differentiate (straight-through).
    stats = x.detach().abs()
    full = k - k % group
    amax = [stats[:, :full].view(m, full // group, group).amax(dim=2)]
    # A partial last group by itself, not by padding: inductor's CPU codegen cannot mix a pad
    # mask with float8 values (docs/kernels/fp8_blockwise.md).
    if full < k:
        amax.append(stats[:, full:].amax(dim=1, keepdim=True))
    scale = scales_from_amax(torch.cat(amax, dim=1), scale_format)
    return _to_e4m3(x / scale[:, group_index(k, group, x.device)]), scale


def fp8_blockwise_linear_reference(
    x: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    *,
    block_size: tuple[int, int],
    act_group_size: int,
    scale_format: ScaleFormat,
    weight_only: bool,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ W.T + bias, computed the way the FP8 kernels compute it.

    W8A8 (weight_only=False): x is quantized per token per `act_group_size` channels; for each
    activation group the fp8 x fp8 partial product is taken, rounded to fp32, multiplied by
    (activation scale x weight block scale) and accumulated in fp32 in K order (DeepSeek-V3
    §3.3.2, DeepGEMM's promotion to fp32 per K block); bias is added in fp32 and the result is
    cast to x's dtype. Weight-only: W is dequantized to x's dtype and multiplied as in a
    bf16/fp16 MMA, accumulated in float64 and rounded once.

    Each group's partial product is summed in float64, where it is exact: a product of two
    e4m3 values has 8 significant bits and spans 2**-18 .. 2**18, so up to 2**9 of them fit in
    53 bits. The result therefore does not depend on the order of the sum (BLAS blocking, the
    output width), which is what makes a column-parallel shard equal the single-device output
    bit for bit (docs/design.md invariant 6).
    """
    n, k = qdata.shape
    if weight_only:
        return linear_float64(x, dequantize_blockwise(qdata, scale, block_size, x.dtype), bias)
    bn, bk = block_size
    group = act_group_size
    # reshape(-1, 0) is ambiguous; K is static, so this branch costs compile nothing.
    x2d = x.reshape(-1, k) if k else x.reshape(x.shape[:-1].numel(), 0)
    xq, x_scale = quantize_activation_groups(x2d, group, scale_format)
    row_scale = scale[group_index(n, bn, scale.device)]  # [N, ceil(K/bk)]
    xq, wq = e4m3_to_float64(xq), e4m3_to_float64(qdata)
    out = torch.zeros(x2d.shape[0], n, dtype=torch.float32, device=x.device)
    for g, start in enumerate(range(0, k, group)):
        stop = min(start + group, k)
        partial = (xq[:, start:stop] @ wq[:, start:stop].t()).float()  # exact, then rounded
        out = out + partial * (x_scale[:, g, None] * row_scale[None, :, start // bk])
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def fp8_blockwise_linear_dequantized(
    x: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    *,
    block_size: tuple[int, int],
    act_group_size: int,
    scale_format: ScaleFormat,
    weight_only: bool,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference's result by dequantize-and-matmul (`backend="auto"` where no qshard kernel
    runs, the CPU): W8A8 quantizes x per group exactly as the reference does, then multiplies
    the dequantized fp32 activations by the dequantized fp32 weight in one BLAS call (fp32
    sums instead of exact per-group partials, so within fp32 rounding of the reference);
    weight-only multiplies W dequantized to x's dtype in x's dtype."""
    if weight_only:
        return linear_in_dtype(x, dequantize_blockwise(qdata, scale, block_size, x.dtype), bias)
    n, k = qdata.shape
    x2d = x.reshape(-1, k) if k else x.reshape(x.shape[:-1].numel(), 0)
    xq, x_scale = quantize_activation_groups(x2d, act_group_size, scale_format)
    x_values = apply_groups(e4m3_to_float32(xq), x_scale, act_group_size, torch.Tensor.mul_)
    weight = dequantize_blockwise(qdata, scale, block_size, torch.float32)
    out = F.linear(x_values, weight, bias.float() if bias is not None else None)
    return out.to(x.dtype).reshape(*x.shape[:-1], n)
