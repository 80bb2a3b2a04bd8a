"""W4A8: int4 weights on FP8 tensor cores, the reference definitions (plain PyTorch, any device).

An int4 weight's integer codes u - z (u in 0..15, z the group's integer zero code; 8 when
symmetric) lie in -15..15, every one of them exact in float8_e4m3fn (integers up to 16 are).
So a W4A16 weight can multiply FP8 activations on FP8 tensor cores, at twice bf16's rate,
with the weight's per-(row, group) scale applied after each K block's dot, in fp32
(docs/design.md, "W4A8: int4 weights with FP8 activations"):

    y[m, n] = sum over K blocks b of  dot_b(xq[m], u[n] - z[n]) * (x_scale[m, b] * w_scale[n, b])

K blocks are `act_group(group)` = min(group, 128) columns, so that one weight group and one
activation group cover each. Activations are quantized on the fly to e4m3, one fp32 scale
(amax / 448, as the FP8 blockwise layout) per token per K block (`GROUP`: DeepSeek-V3's 1 x 128
activation groups), or per token over all of K (`TOKEN`: compressed-tensors' W4AFP8 preset).
Integer zero points only: a float zero point is not a code, (u - 8) * s + z has no exact e4m3
weight.

`w4a8_linear_reference` follows the kernels' order: each block's dot exact in float64 (an e4m3
value times an integer of 4 bits has 8 significant bits; 128 of them fit in 53), rounded to
fp32, scaled and summed in fp32 in K order; so the result does not depend on N, and a
column-parallel shard equals the single-device output bit for bit (docs/design.md invariant 6).
"""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F

from ..config import ScaleFormat
from .fp8_blockwise import e4m3_to_float32, e4m3_to_float64, quantize_activation_groups
from .int4 import SYMMETRIC_ZERO, dequantize_int4
from .packing import apply_groups, expand_groups, unpack_nibbles

__all__ = [
    "ACT_GROUP_MAX",
    "ActivationQuant",
    "act_group",
    "kernel_problem",
    "quantize_w4a8_activations",
    "w4a8_linear_dequantized",
    "w4a8_linear_reference",
]

ACT_GROUP_MAX = 128  # DeepSeek-V3's activation group; finer weight groups take theirs
# The Triton kernel's smallest K block: it takes a block's even and odd columns in two fp8 dots
# (kernels/w4a8_triton/tiles.py), each of at least 32 (the fp8 dot's smallest K).
MIN_KERNEL_BLOCK = 64


class ActivationQuant(str, enum.Enum):
    """How an int4 weight's activations are quantized (module docstring)."""

    NONE = "none"  # weight-only (W4A16): activations stay bf16 / fp16
    FP8_GROUP = "fp8_group"  # e4m3 per token per K block of min(group, 128)
    FP8_TOKEN = "fp8_token"  # e4m3 per token (compressed-tensors' W4AFP8)


def act_group(group: int) -> int:
    """The K block of a W4A8 matmul with weight groups of `group`: min(group, 128)."""
    return min(group, ACT_GROUP_MAX)


def kernel_problem(group: int) -> str | None:
    """Why the W4A8 kernel cannot run weights of `group`-column groups (groups of 32, or a TP
    cut re-grouped finer than 64), or None."""
    block = act_group(group)
    if block < MIN_KERNEL_BLOCK:
        return (
            f"groups of {group} columns make K blocks of {block}; the W4A8 kernel takes "
            f"{MIN_KERNEL_BLOCK} or more"
        )
    return None


def quantize_w4a8_activations(
    x2d: torch.Tensor, group: int, mode: ActivationQuant
) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] float -> (e4m3 [M, K], fp32 scales [M, ceil(K / act_group(group))]); per token,
    the one scale repeated over the blocks."""
    m, k = x2d.shape
    block = act_group(group)
    if mode is ActivationQuant.FP8_TOKEN:
        xq, scale = quantize_activation_groups(x2d, max(k, 1), ScaleFormat.FP32)
        return xq, scale[:, :1].expand(m, -(-k // block))
    return quantize_activation_groups(x2d, block, ScaleFormat.FP32)


def _flat(x: torch.Tensor, k: int) -> torch.Tensor:
    return x.reshape(-1, k) if k else x.reshape(x.shape[:-1].numel(), 0)


def _codes(packed: torch.Tensor, zero: torch.Tensor, group: int, k: int) -> torch.Tensor:
    """u - z in float32 (exact integers in -15..15), [N, K]."""
    u = unpack_nibbles(packed, k).float()
    if zero.numel():
        return apply_groups(u, zero.float(), group, torch.Tensor.sub_)
    return u.sub_(SYMMETRIC_ZERO)


def w4a8_linear_reference(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group: int,
    mode: ActivationQuant,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ W.T + bias as the W4A8 kernels compute it (module docstring), in x's dtype."""
    n, k = packed.shape[0], x.shape[-1]
    block = act_group(group)
    x2d = _flat(x, k)
    xq, x_scale = quantize_w4a8_activations(x2d, group, mode)
    xq, codes = e4m3_to_float64(xq), _codes(packed, zero, group, k).double()
    w_scale = scale.float()
    out = torch.zeros(x2d.shape[0], n, dtype=torch.float32, device=x.device)
    for b, start in enumerate(range(0, k, block)):
        stop = min(start + block, k)
        partial = (xq[:, start:stop] @ codes[:, start:stop].t()).float()  # exact, then rounded
        out = out + partial * (x_scale[:, b, None] * w_scale[None, :, start // group])
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def w4a8_linear_dequantized(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group: int,
    mode: ActivationQuant,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference's result by dequantize-and-matmul (`backend="auto"` where no W4A8 kernel
    runs: the CPU, groups finer than 64): the activations quantized exactly as the
    reference, then one fp32 BLAS call of the dequantized values (fp32 sums instead of exact
    per-block partials, so within fp32 rounding of the reference)."""
    n, k = packed.shape[0], x.shape[-1]
    x2d = _flat(x, k)
    xq, x_scale = quantize_w4a8_activations(x2d, group, mode)
    x_values = e4m3_to_float32(xq) * expand_groups(x_scale, act_group(group), k)
    weight = dequantize_int4(packed, scale, zero, group, k, torch.float32)
    out = F.linear(x_values, weight, bias.float() if bias is not None else None)
    return out.to(x.dtype).reshape(*x.shape[:-1], n)
