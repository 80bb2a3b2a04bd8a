"""Helpers shared by the 4-bit reference definitions (int4, MXFP4): two codes per byte along K
and per-group statistics along K (the last group may be partial)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["expand_groups", "group_reduce", "linear_float64", "pack_nibbles", "unpack_nibbles"]


def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] in 0..15 -> uint8 [N, ceil(K/2)], even index in the low nibble."""
    if u.shape[1] % 2:
        u = F.pad(u, (0, 1))
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor, k: int) -> torch.Tensor:
    """uint8 [N, ceil(K/2)] -> uint8 [N, K].

    By indexing, not `stack([low, high], -1).reshape(...)`: inductor's CPU codegen (torch 2.13)
    mis-strides that reshape in a dynamic-shape TP graph (a size/stride assertion fails).
    """
    channels = torch.arange(k, device=packed.device)
    shifts = ((channels % 2) * 4).to(torch.uint8)
    return (packed[:, channels // 2] >> shifts) & 0x0F


def group_reduce(weight: torch.Tensor, group: int, reduce) -> torch.Tensor:
    """reduce(values, dim) over each row's groups of `group` channels; the last may be partial."""
    n, k = weight.shape
    full = k - k % group
    parts = [reduce(weight[:, :full].reshape(n, full // group, group), 2)] if full else []
    if full < k:
        parts.append(reduce(weight[:, full:], 1).unsqueeze(1))
    return torch.cat(parts, dim=1) if parts else weight.new_zeros(n, 0)


def expand_groups(values: torch.Tensor, group: int, k: int) -> torch.Tensor:
    """[N, ceil(K/group)] -> [N, K], each group's value over its channels."""
    return values[:, torch.arange(k, device=values.device) // group]


def linear_float64(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """x @ weight.T + bias for a weight already in x's dtype (what a weight-only kernel
    multiplies), accumulated in float64 and rounded once to x's dtype: exact enough that the
    result does not depend on BLAS blocking, so column-parallel shards equal the single-device
    output bit for bit."""
    out = x.double() @ weight.double().t()
    if bias is not None:
        out = out + bias.to(x.dtype).double()
    return out.to(x.dtype)
