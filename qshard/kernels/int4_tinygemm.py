"""The tinygemm backend of the int4 layout: PyTorch's own int4 kernels (`aten._weight_int4pack_mm`
on CUDA, `aten._weight_int4pack_mm_for_cpu` on the CPU), on a device form made from the
canonical packing (`kernels/int4.py`).

tinygemm's weight is W = (q - 8) * scale + zero with q in 0..15 (docs/design.md, "PyTorch
behaviour"), so the canonical W = (u - z) * s maps to q = u, scale = s and zero = (8 - z) * s. That
zero is rounded once to the scale dtype (bf16 on CUDA; on the CPU the activation's dtype), so the
weights differ from the canonical ones by at most 8 * s * 2^-9 (bf16): symmetric weights (z = 8) are
exact. A float zero point (zero_point_domain 'float') is tinygemm's own zero, exact on CUDA. The CPU
form is made for the weight's dtype, so `.to(dtype)` re-makes it.

tinygemm takes groups of 32..256, K a multiple of the group (and, on CUDA, of its 16 *
inner_k_tiles columns) and N a multiple of 16 (CPU) or 8 (CUDA). The form pads to those with
weights that dequantize to exactly 0 (code 8, scale 1, zero 0); the activations are padded
with zeros along K and the padded output rows are dropped, so any shape runs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..errors import BackendUnavailableError
from .packing import unpack_nibbles

__all__ = ["TINYGEMM_GROUPS", "tinygemm_form", "tinygemm_linear", "tinygemm_problem"]

TINYGEMM_GROUPS = (32, 64, 128, 256)
N_MULTIPLE = 16  # the CPU kernel's rule (CUDA needs 8): one rule for both devices
PAD_CODE = 8  # (8 - 8) * 1 + 0 = 0


def tinygemm_problem(device: torch.device, group: int, dtype: torch.dtype | None) -> str | None:
    """Why tinygemm cannot run a weight of `group`-groups with `dtype` activations on `device`
    (dtype None: any), or None."""
    if device.type not in ("cpu", "cuda"):
        return f"tinygemm runs on CPU and CUDA devices, not {device.type}"
    if group not in TINYGEMM_GROUPS:
        return (
            f"tinygemm takes groups of {list(TINYGEMM_GROUPS)}, and this weight has groups of "
            f"{group} (a tensor-parallel cut re-grouped it)"
        )
    if device.type == "cuda" and dtype not in (None, torch.bfloat16):
        return f"tinygemm on CUDA takes bfloat16 activations, not {dtype}"
    return None


def _inner_k_tiles(k_padded: int) -> int:
    return next(t for t in (8, 4, 2) if k_padded % (16 * t) == 0)


def tinygemm_form(
    qdata: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group: int,
    k: int,
    dtype: torch.dtype,
    float_zero: bool = False,
) -> tuple[dict[str, torch.Tensor], tuple[int, ...]]:
    """({"tinygemm_qdata", "tinygemm_scale_zero"}, (group, K, N)) for the canonical int4 weight
    on qdata's device. scale_zero is [K_pad / group, N_pad, 2]: bf16 on CUDA; on the CPU, whose
    kernel takes it in the activation dtype, in the weight's dtype `dtype` (what activations
    are expected in; another is cast per call)."""
    n, device = qdata.shape[0], qdata.device
    groups = scale.shape[1]
    k_pad, n_pad = groups * group, -(-n // N_MULTIPLE) * N_MULTIPLE
    codes = torch.full((n_pad, k_pad), PAD_CODE, dtype=torch.int32, device=device)
    codes[:n, :k] = unpack_nibbles(qdata, k).to(torch.int32)
    z = zero.float() if zero.numel() else torch.full_like(scale, 8.0, dtype=torch.float32)
    scale_zero = torch.zeros(groups, n_pad, 2, dtype=torch.float32, device=device)
    scale_zero[:, :, 0] = 1.0
    scale_zero[:, :n, 0] = scale.float().t()
    # tinygemm's W = (u - 8) * s + zero: a float zero point is its own; a code z is (8 - z) * s.
    scale_zero[:, :n, 1] = (z if float_zero else (8.0 - z) * scale.float()).t()
    tiles = _inner_k_tiles(k_pad)
    if device.type == "cuda":
        # The CUDA kernel reads bytes with the even index in the high nibble.
        packed = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)
        weight = torch.ops.aten._convert_weight_to_int4pack(packed, tiles)
        scale_zero = scale_zero.to(torch.bfloat16)
    else:
        weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, tiles)
        scale_zero = _cpu_scale_zero(scale_zero, dtype)
    return {"tinygemm_qdata": weight, "tinygemm_scale_zero": scale_zero.contiguous()}, (
        group,
        k,
        n,
    )


def _cpu_scale_zero(scale_zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The CPU kernel's scales and zeros, in the activation dtype; fp16 cannot hold every bf16
    scale (above 65504: weights beyond fp16's range), which is refused, not turned into inf."""
    converted = scale_zero.to(dtype)
    if not bool(torch.isfinite(converted).all()):
        largest = float(scale_zero.float().abs().max())
        raise BackendUnavailableError(
            f"tinygemm on the CPU takes its scales and zeros in the activation dtype {dtype}, "
            f"which cannot hold this weight's (largest {largest:.3g}); use bfloat16 or float32 "
            f"activations, or backend='auto'"
        )
    return converted


def tinygemm_linear(
    x: torch.Tensor, tensors: dict[str, torch.Tensor], meta: tuple[int, ...], bias
) -> torch.Tensor:
    """y = x @ W.T + bias through tinygemm; x [..., K] on the form's device."""
    group, k, n = meta
    weight, scale_zero = tensors["tinygemm_qdata"], tensors["tinygemm_scale_zero"]
    rows = math.prod(x.shape[:-1])
    x2d = x.reshape(rows, k)  # (not -1: ambiguous for K = 0)
    k_pad = scale_zero.shape[0] * group
    if k_pad != k:
        x2d = F.pad(x2d, (0, k_pad - k))
    if rows == 0 or k == 0 or n == 0:  # empty sums are zeros; tinygemm takes no empty operand
        out = x2d.new_zeros(rows, n)
    elif x.device.type == "cuda":
        out = torch.ops.aten._weight_int4pack_mm(x2d.contiguous(), weight, group, scale_zero)
    else:
        if scale_zero.dtype != x.dtype:
            scale_zero = _cpu_scale_zero(scale_zero, x.dtype)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2d.contiguous(), weight, group, scale_zero
        )
    out = out[:, :n]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], n)
