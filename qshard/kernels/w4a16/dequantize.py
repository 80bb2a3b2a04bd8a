"""Dequantize + cuBLAS: the weight is dequantized once into the activation dtype (bit-exact
against the reference) and `F.linear` multiplies. The op runs it above 128 tokens, where the
matmul is compute-bound (`select.py`), and wherever no fused kernel runs on native codes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..packing import NATIVE_CHUNK, check_native_order
from .decode import load_global_scale, scale_arg, step_codes, step_weights
from .format import Format

__all__ = ["config", "dequantize_weight", "launch", "problem"]


def problem(fmt: int, x: torch.Tensor, qdata: torch.Tensor, group: int) -> str | None:
    """None: dequantize runs every format, group and shape."""
    return None


def config(native: bool = False) -> dict:
    """Its only setting: whether the codes are in `packing.native_codes`' order."""
    return {"KERNEL": "dequantize", "NATIVE": 1} if native else {"KERNEL": "dequantize"}


@triton.jit
def _native_bytes(q_ptr, offs_n, k0, n_ok, stride_qn):
    """The codes of the 128-column chunk at k0, stored in `packing.native_codes`' order, as the
    canonical bytes [rows, 64] (byte j: columns 2j and 2j + 1). Native position
    d = 32 w_hi + 8 w_lo + 4 n_hi + n_lo (word w = 4 w_hi + w_lo, nibble n = 4 n_hi + n_lo)
    holds column c = 32 w_lo + 8 n_lo + 2 w_hi + n_hi (`packing.native_codes`), so the chunk's
    nibbles, loaded as they lie (64 contiguous bytes a row: whole 16-byte loads), reach the
    canonical order by one reshape and permute of their index digits. (Gathering each byte twice
    at its permuted offset instead made dequantize + cuBLAS at 2048 tokens take 2110 us for the
    Llama layer against 1491 us on canonical codes, H100.)"""
    rows = q_ptr + offs_n[:, None] * stride_qn + k0 // 2
    raw = tl.load(rows + tl.arange(0, 64)[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
    ROWS: tl.constexpr = raw.shape[0]
    nibbles = tl.reshape(tl.join(raw & 0xF, raw >> 4), (ROWS, 4, 4, 2, 4))  # [w_hi, w_lo, n]
    nibbles = tl.permute(nibbles, (0, 2, 4, 1, 3))  # [w_lo, n_lo, w_hi, n_hi]: column order
    low, high = tl.split(tl.reshape(nibbles, (ROWS, 64, 2)))
    return (low | (high << 4)).to(tl.uint8)


@triton.jit
def _dequantize_kernel(
    q_ptr,
    s_ptr,
    z_ptr,
    g_ptr,
    w_ptr,
    N,
    K,
    KH,
    stride_qn,
    stride_sn,
    stride_wn,
    FORMAT: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NATIVE: tl.constexpr = False,
):
    """W [N, K] in w's dtype, each value rounded once from fp32 (bit-exact vs the reference).
    NATIVE: the codes in `packing.native_codes`' order (BLOCK_K is its 128-column chunk)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    packed, scale, zero = step_codes(
        q_ptr,
        s_ptr,
        z_ptr,
        offs_n,
        k0,
        N,
        K,
        KH,
        stride_qn,
        stride_sn,
        FORMAT,
        GROUP,
        BLOCK_K,
        False,
    )
    if NATIVE:
        packed = _native_bytes(q_ptr, offs_n, k0, offs_n < N, stride_qn)
    w = step_weights(packed, scale, zero, load_global_scale(g_ptr, FORMAT), FORMAT, GROUP, BLOCK_K)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    rows = offs_n.to(tl.int64)[:, None] * stride_wn  # N * K may pass 2**31 (a large lm_head)
    tl.store(w_ptr + rows + offs_k[None, :], w.to(w_ptr.dtype.element_ty), mask=mask)


def dequantize_weight(
    fmt: Format,
    qdata,
    scale,
    zero,
    global_scale,
    group: int,
    k: int,
    dtype: torch.dtype,
    native: bool = False,
) -> torch.Tensor:
    """W [N, K] in `dtype`; `native`: the codes in `packing.native_codes`' order."""
    fmt = Format(fmt)
    if native:
        check_native_order(fmt.is_int4, group, fmt.name)
        if k % NATIVE_CHUNK:
            raise ValueError(
                f"int4 codes in the native order hold whole {NATIVE_CHUNK}-column "
                f"chunks: K = {k} is not a multiple of {NATIVE_CHUNK}"
            )
    n = qdata.shape[0]
    w = torch.empty((n, k), dtype=dtype, device=qdata.device)
    if n == 0 or k == 0:
        return w
    block_n, block_k = 32, 128
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _dequantize_kernel[grid](
        qdata,
        scale_arg(scale),
        zero if zero.numel() else qdata,
        global_scale,
        w,
        n,
        k,
        qdata.shape[1],
        qdata.stride(0),
        scale.stride(0),
        w.stride(0),
        FORMAT=int(fmt),
        GROUP=group,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        NATIVE=native,
        num_warps=4,
    )
    return w


def launch(
    fmt: int, x, qdata, scale, zero, bias, out, group: int, config: dict, global_scale
) -> torch.Tensor:
    """x @ W.T + bias by cuBLAS on the dequantized weight (`out` is not used)."""
    weight = dequantize_weight(
        fmt,
        qdata,
        scale,
        zero,
        global_scale,
        group,
        x.shape[1],
        x.dtype,
        bool(config.get("NATIVE")),
    )
    return F.linear(x, weight, bias)
