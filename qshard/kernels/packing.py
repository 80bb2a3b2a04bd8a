"""Helpers shared by the 4-bit reference definitions (int4, MXFP4): two codes per byte along K
and per-group statistics along K (the last group may be partial)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "NATIVE_CHUNK",
    "apply_groups",
    "canonical_codes",
    "check_native_order",
    "expand_groups",
    "group_reduce",
    "linear_float64",
    "native_codes",
    "pack_nibbles",
    "unpack_nibbles",
]

NATIVE_CHUNK = 128  # the columns the native code order permutes within (`native_codes`)


def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] in 0..15 -> uint8 [N, ceil(K/2)], even index in the low nibble."""
    if u.shape[1] % 2:
        u = F.pad(u, (0, 1))
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor, k: int) -> torch.Tensor:
    """uint8 [N, ceil(K/2)] -> uint8 [N, K].

    Compiled, by indexing, not `stack([low, high], -1).reshape(...)`: inductor's CPU codegen
    (torch 2.13) mis-strides that reshape in a dynamic-shape TP graph (a size/stride assertion
    fails), and fuses the gather anyway. Eager, by the stack: the gather costs 4x as much on CPU
    (2.7 vs 0.6 ms for a 2816 x 1024 weight, docs/cpu.md).
    """
    if torch.compiler.is_compiling():
        channels = torch.arange(k, device=packed.device)
        shifts = ((channels % 2) * 4).to(torch.uint8)
        return (packed[:, channels // 2] >> shifts) & 0x0F
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(1)[:, :k]


def _native_source(device: torch.device) -> torch.Tensor:
    """For each code position d of a 128-column chunk in the native order (word d // 8,
    nibble d % 8), the chunk's column it holds (`native_codes`)."""
    d = torch.arange(NATIVE_CHUNK, device=device)
    word, nibble = d // 8, d % 8
    return 32 * (word % 4) + 8 * (nibble % 4) + 2 * (word // 4) + nibble // 4


def _permute_chunks(qdata: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Codes [..., K / 2] with each 128-column chunk's codes gathered by `index`."""
    packed = qdata.view(torch.uint8)
    lead, k = packed.shape[:-1], 2 * packed.shape[-1]
    if k % NATIVE_CHUNK:
        raise ValueError(
            f"the native code order permutes whole {NATIVE_CHUNK}-column chunks: "
            f"K % {NATIVE_CHUNK} == 0, not K = {k}"
        )
    rows = packed.reshape(-1, k // 2)
    codes = unpack_nibbles(rows, k).view(rows.shape[0], k // NATIVE_CHUNK, NATIVE_CHUNK)
    out = pack_nibbles(codes[:, :, index].reshape(rows.shape[0], k))
    return out.reshape(*lead, k // 2).view(qdata.dtype)


def native_codes(qdata: torch.Tensor) -> torch.Tensor:
    """int4 codes [..., K / 2] (the canonical packing) in the native order of the register
    kernels (w4a16/register_wgmma.py's config NATIVE = 1, and the word GEMV's): in each 128-column
    chunk, 32-bit word w (of 16), nibble n holds column 32 (w % 4) + 8 (n % 4) + 2 (w // 4) +
    n // 4, so that thread t's word j decodes, nibbles b and b + 4 as pair b, into MMA columns
    32 j + 8 b + 2 t + h: x's own columns, which TMA then copies as they are."""
    return _permute_chunks(qdata, _native_source(qdata.device))


def canonical_codes(qdata: torch.Tensor) -> torch.Tensor:
    """The inverse of `native_codes`: column c of a chunk comes from native position
    32 ((c // 2) % 4) + 8 (c // 32) + 4 (c % 2) + (c // 8) % 4."""
    return _permute_chunks(qdata, _native_source(qdata.device).argsort())


def check_native_order(int4: bool, group: int, format_name: str) -> None:
    """Raises ValueError unless a kernel can read codes of this format and group in
    `native_codes`' order: int4 codes (the register kernels' e2m1 decode takes a byte's two
    codes as a pair) in groups of NATIVE_CHUNK or a multiple (a word's codes span a chunk, so
    its group must hold whole chunks: FP4's groups of 16 and 32, and int4 re-grouped by a TP
    cut, do not; the wgmma kernel's consumers also load one scale per canonical 32-column run)."""
    if not int4 or group % NATIVE_CHUNK:
        raise ValueError(
            f"the native code order is for int4 formats with groups of "
            f"{NATIVE_CHUNK} or a multiple: not {format_name}, group {group}"
        )


def group_reduce(weight: torch.Tensor, group: int, reduce) -> torch.Tensor:
    """reduce(values, dim) over each row's groups of `group` channels; the last may be partial."""
    n, k = weight.shape
    full = k - k % group
    parts = [reduce(weight[:, :full].reshape(n, full // group, group), 2)] if full else []
    if full < k:
        parts.append(reduce(weight[:, full:], 1).unsqueeze(1))
    return torch.cat(parts, dim=1) if parts else weight.new_zeros(n, 0)


def expand_groups(values: torch.Tensor, group: int, k: int) -> torch.Tensor:
    """[N, ceil(K/group)] -> [N, K], each group's value over its channels.

    Eager, a broadcast copy (0.25 ms for a 2816 x 1024 weight on CPU); compiled, the gather
    inductor has always been given (it fuses it; its CPU codegen has mis-handled reshapes of
    expanded and repeated scales before, kernels/fp8_blockwise.py)."""
    if torch.compiler.is_compiling():
        return values[:, torch.arange(k, device=values.device) // group]
    n, groups = values.shape
    return values[:, :, None].expand(n, groups, group).reshape(n, groups * group)[:, :k]


def apply_groups(values: torch.Tensor, group_values: torch.Tensor, group: int, op):
    """op(values, each group's value over its channels) for values [N, K] and group_values
    [N, ceil(K/group)]: elementwise, so bit for bit `op(values, expand_groups(...))`, without
    making the expanded [N, K] operand where K is a whole number of groups. `op` may be an
    in-place op (`torch.Tensor.mul_`) on a `values` the caller owns: on CPU the out-of-place
    steps, each a fresh [N, K] tensor, measured 3.5x slower (4.6 vs 1.3 ms for an int4
    dequantization of 2816 x 1024, docs/cpu.md)."""
    n, k = values.shape
    if k % group or not values.is_contiguous():
        return op(values, expand_groups(group_values, group, k))
    return op(values.view(n, k // group, group), group_values[:, :, None]).view(n, k)


def linear_in_dtype(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """x @ weight.T + bias for a weight already dequantized to x's dtype, by the BLAS of x's
    device in x's dtype: `backend="auto"` where no qshard kernel runs (the CPU). The same
    products as `linear_float64`, summed in the BLAS's order and precision instead of exactly."""
    return F.linear(x, weight, bias.to(x.dtype) if bias is not None else None)


def linear_float64(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """x @ weight.T + bias for a weight already in x's dtype (what a weight-only kernel
    multiplies), accumulated in float64 and rounded once to x's dtype: exact enough that the
    result does not depend on BLAS blocking, so column-parallel shards equal the single-device
    output bit for bit."""
    out = x.double() @ weight.double().t()
    if bias is not None:
        out = out + bias.to(x.dtype).double()
    return out.to(x.dtype)
