"""Weight-only 4-bit (W4A16) kernels in Triton, one family for every 4-bit layout: int4
(asymmetric and symmetric), MXFP4 and NVFP4. They differ only in how a code and its group's
scale become a weight (`_values`, `_group_scale`); the loops are shared.

Codes are packed two per byte along K, the even index in the low nibble (every layout's
canonical packing). The kernels never interleave the nibbles: each K step splits into the
even-index weights (low nibbles) and the odd-index ones (high nibbles), and multiplies them with
the even and odd activations. (v2 joined the nibbles into K order in registers, `tl.join` +
reshape, and ran at 0.5 TB/s on an H200: docs/kernels/int4.md.)

- M = 1 (decode): a GEMV. Each program takes BLOCK_N weight rows and streams BLOCK_K of K per
  step; codes times activations in fp32, summed per group, then the group's scale (and zero
  point) applied to the sum; no tensor cores. It multiplies the exact weight, not the weight
  rounded to the activation dtype as the reference does: the difference is within the
  activation dtype's rounding (the tests' tolerance).
- 2 <= M <= FUSED_MAX_M: a tensor-core kernel, "swap AB" (weight rows on the MMA's M side, the
  tokens on its N side), K split over programs so a 4096-wide layer fills the GPU (`split_k.py`).
  The weight tile is dequantized in fp32 and rounded to the activation dtype, as the reference.
- Above: the weight is dequantized once into the activation dtype (bit-exact vs the reference)
  and cuBLAS multiplies (`F.linear`): compute-bound there.

Formats (FORMAT, a constexpr):
    INT4_ASYM  W = (u - zero) * scale, bf16 scale and zero     computed as fma(u, s, -z*s): exact
    INT4_SYM   W = (u - 8) * scale                              the same with z = 8
    MXFP4      W = e2m1(c) * 2**(e - 127), e8m0 byte e           exact products
    NVFP4      W = (e2m1(c) * e4m3 scale) * global_scale         the reference's order
Ops: `torch.ops.qshard.int4_linear`, `.mxfp4_linear`, `.nvfp4_linear` (fake implementations
beside them); references: `int4.py`, `mxfp4.py`, `nvfp4.py`.
"""

from __future__ import annotations

import enum
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .split_k import finish_tile, split_count, workspace

__all__ = ["Format", "dequantize_launch", "gemv_config", "linear_launch", "small_m_config"]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


class Format(enum.IntEnum):
    INT4_ASYM = 0
    INT4_SYM = 1
    MXFP4 = 2
    NVFP4 = 3


_INT4_ASYM: tl.constexpr = tl.constexpr(int(Format.INT4_ASYM))
_INT4_SYM: tl.constexpr = tl.constexpr(int(Format.INT4_SYM))
_MXFP4: tl.constexpr = tl.constexpr(int(Format.MXFP4))
_NVFP4: tl.constexpr = tl.constexpr(int(Format.NVFP4))

GEMV_MAX_M = 1
FUSED_MAX_M = 128
MIN_STEPS_PER_SPLIT = 4


# ---- decoding ----------------------------------------------------------------------------------


@triton.jit
def _values(c, FORMAT: tl.constexpr):
    """4-bit codes (int32, 0..15) -> fp32 values before the group scale: the code itself (int4)
    or its e2m1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign)."""
    if FORMAT >= _MXFP4:  # MXFP4 or NVFP4: e2m1 codes
        c7 = c & 7
        # c7 = 2e + m with e >= 1 is (1 + m/2) * 2**(e - 1): the fp32 with exponent field
        # e + 126 and mantissa bit 22 = m, i.e. the bits (c7 << 22) + (126 << 23); c7 = 1 is 0.5.
        normal = ((c7 << 22) + 0x3F000000).to(tl.float32, bitcast=True)
        magnitude = tl.where(c7 >= 2, normal, c7.to(tl.float32) * 0.5)
        return tl.where((c & 8) != 0, -magnitude, magnitude)
    else:
        # u as a float without a conversion instruction: the bits 0x4B000000 | u are 2**23 + u.
        return (c | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _group_scale(s_ptr, z_ptr, offs, mask, FORMAT: tl.constexpr):
    """(mul, add) per (row, group) so that a weight is value * mul + add (exact in fp32)."""
    if FORMAT == _MXFP4:  # e8m0: the byte e is 2**(e - 127); e = 0 is the subnormal 2**-127
        e = tl.load(s_ptr + offs, mask=mask, other=127).to(tl.int32)
        mul = tl.where(e == 0, 2.0**-127, (e << 23).to(tl.float32, bitcast=True))
        return mul, mul  # (no additive term: `_weight_halves` ignores it)
    elif FORMAT == _NVFP4:
        mul = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        return mul, mul
    else:
        mul = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if FORMAT == _INT4_ASYM:
            zero = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            zero = tl.full(mul.shape, 8.0, tl.float32)
        return mul, -(zero * mul)  # (u - z) * s = u * s - z * s, both products exact


@triton.jit
def _step_codes(q_ptr, s_ptr, z_ptr, offs_n, k0, N, K, KH, stride_qn, stride_sn,
                FORMAT: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr):  # fmt: skip
    """The loads of the K step at k0: codes [rows, BLOCK_K / 2] (bytes; KH per row) and the
    (mul, add) of each group [rows, G]. Issued a step ahead of their use (Triton pipelines only
    loads that feed a dot, and these feed the decoding); a step at k0 >= K loads nothing.
    EVEN_K (K a multiple of BLOCK_K): no mask along K, so the loads stay 16 bytes wide."""
    SUB: tl.constexpr = (GROUP if GROUP < BLOCK_K else BLOCK_K) // 2  # bytes of one group
    G: tl.constexpr = BLOCK_K // (2 * SUB)
    byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    n_ok = offs_n < N * (k0 < K)  # (no rows at all past K)
    q_ptrs = q_ptr + offs_n[:, None] * stride_qn + byte[None, :]
    if EVEN_K:
        packed = tl.load(q_ptrs, mask=n_ok[:, None], other=0)
    else:
        packed = tl.load(q_ptrs, mask=n_ok[:, None] & (byte < KH)[None, :], other=0)
    group = (k0 + tl.arange(0, G) * (2 * SUB)) // GROUP
    g_ok = n_ok[:, None] & (group < tl.cdiv(K, GROUP))[None, :]
    mul, add = _group_scale(s_ptr, z_ptr, offs_n[:, None] * stride_sn + group[None, :], g_ok,
                            FORMAT)  # fmt: skip
    return packed, mul, add


@triton.jit
def _step_activations(x_ptr, offs_m, k0, M, K, stride_xm, BLOCK_K: tl.constexpr,
                      EVEN_K: tl.constexpr):  # fmt: skip
    """x[offs_m, k0 : k0 + BLOCK_K], loaded whole (contiguous along K), split into the
    even-index and odd-index activations and transposed for the MMA: [BLOCK_K / 2, tokens]
    each. The weights are never interleaved; the activations are split instead."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    m_ok = offs_m < M * (k0 < K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    if EVEN_K:
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
    else:
        x = tl.load(x_ptrs, mask=m_ok[:, None] & (offs_k < K)[None, :], other=0.0)
    even, odd = tl.split(tl.reshape(x, (offs_m.shape[0], BLOCK_K // 2, 2)))
    return tl.trans(even), tl.trans(odd)


@triton.jit
def _row_activations(x_ptr, k0, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """One token's x[k0 : k0 + BLOCK_K] in fp32, split into even and odd indices."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if EVEN_K:
        x = tl.load(x_ptr + offs_k, mask=offs_k < K * (k0 < K), other=0.0)
    else:
        x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0)
    return tl.split(tl.reshape(x.to(tl.float32), (BLOCK_K // 2, 2)))


@triton.jit
def _weight_halves(packed, mul, add, FORMAT: tl.constexpr, GROUP: tl.constexpr,
                   BLOCK_K: tl.constexpr):  # fmt: skip
    """The weights at the even and odd indices of a step, [rows, BLOCK_K / 2] each, fp32:
    decoded codes times their group's mul, plus add (int4). NVFP4's global scale is left out.
    Past K: codes 0, scales 0, so these weights are 0 or finite; the activations are 0 there."""
    SUB: tl.constexpr = (GROUP if GROUP < BLOCK_K else BLOCK_K) // 2
    G: tl.constexpr = BLOCK_K // (2 * SUB)
    ROWS: tl.constexpr = packed.shape[0]
    packed = tl.reshape(packed.to(tl.int32), (ROWS, G, SUB))
    mul, add = mul[:, :, None], add[:, :, None]
    if FORMAT >= _MXFP4:  # e2m1: no "+ 0", which would turn the code -0 into +0
        low = _values(packed & 15, FORMAT) * mul
        high = _values(packed >> 4, FORMAT) * mul
    else:
        low = _values(packed & 15, FORMAT) * mul + add
        high = _values(packed >> 4, FORMAT) * mul + add
    return tl.reshape(low, (ROWS, BLOCK_K // 2)), tl.reshape(high, (ROWS, BLOCK_K // 2))


@triton.jit
def _global_scale(g_ptr, FORMAT: tl.constexpr):
    if FORMAT == _NVFP4:
        return tl.load(g_ptr).to(tl.float32)
    else:
        return 1.0


# ---- kernels -----------------------------------------------------------------------------------


@triton.jit
def _gemv_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, out_ptr,
    M, N, K, KH, stride_xm, stride_qn, stride_sn, stride_om,
    FORMAT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[m, n-band] for one token m, streaming the band's codes BLOCK_K values at a time.

    The group scale is applied to each group's sum, not to each weight (as the FP8 GEMV does):
    sum_k (u_k - z) s x_k = s * sum_k u_k x_k - z s * sum_k x_k (int4), s * sum_k v_k x_k
    (FP4). Per weight that leaves decoding the code and one FMA."""
    pid = tl.program_id(0)
    m = pid % M  # the programs of one weight band run together and share it through L2
    offs_n = (pid // M) * BLOCK_N + tl.arange(0, BLOCK_N)
    SUB: tl.constexpr = (GROUP if GROUP < BLOCK_K else BLOCK_K) // 2  # bytes of one group
    G: tl.constexpr = BLOCK_K // (2 * SUB)
    x_ptr += m * stride_xm
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    packed, mul, add = _step_codes(q_ptr, s_ptr, z_ptr, offs_n, 0, N, K, KH, stride_qn,
                                   stride_sn, FORMAT, GROUP, BLOCK_K, EVEN_K)  # fmt: skip
    x_even, x_odd = _row_activations(x_ptr, 0, K, BLOCK_K, EVEN_K)
    for k0 in range(0, K, BLOCK_K):
        next_packed, next_mul, next_add = _step_codes(
            q_ptr, s_ptr, z_ptr, offs_n, k0 + BLOCK_K, N, K, KH, stride_qn, stride_sn,
            FORMAT, GROUP, BLOCK_K, EVEN_K,
        )  # fmt: skip
        next_even, next_odd = _row_activations(x_ptr, k0 + BLOCK_K, K, BLOCK_K, EVEN_K)
        codes = packed.to(tl.int32)
        products = (_values(codes & 15, FORMAT) * x_even[None, :]
                    + _values(codes >> 4, FORMAT) * x_odd[None, :])  # fmt: skip
        partial = tl.sum(tl.reshape(products, (BLOCK_N, G, SUB)), axis=2)  # [BLOCK_N, G]
        if FORMAT >= _MXFP4:
            acc += tl.sum(partial * mul, axis=1)
        else:
            x_sum = tl.sum(tl.reshape(x_even + x_odd, (G, SUB)), axis=1)
            acc += tl.sum(partial * mul + x_sum[None, :] * add, axis=1)
        packed, mul, add, x_even, x_odd = next_packed, next_mul, next_add, next_even, next_odd
    total = acc * _global_scale(g_ptr, FORMAT)
    n_ok = offs_n < N
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _small_m_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, out_ptr, partials_ptr, arrived_ptr,
    M, N, K, KH, steps_per_split, stride_xm, stride_qn, stride_sn, stride_om,
    FORMAT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    X_FP32: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out.T[n-tile, m-tile] = W[n-tile] @ x[m-tile].T over this program's K steps, as two
    MMAs per step: the even-index weights with the even activations, the odd with the odd."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first_step = tl.program_id(1) * steps_per_split
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    last_step = tl.minimum(first_step + steps_per_split, tl.cdiv(K, BLOCK_K))
    global_scale = _global_scale(g_ptr, FORMAT)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k0 = first_step * BLOCK_K
    packed, mul, add = _step_codes(q_ptr, s_ptr, z_ptr, offs_n, k0, N, K, KH, stride_qn,
                                   stride_sn, FORMAT, GROUP, BLOCK_K, EVEN_K)  # fmt: skip
    x_even, x_odd = _step_activations(x_ptr, offs_m, k0, M, K, stride_xm, BLOCK_K, EVEN_K)
    for step in range(first_step, last_step):
        # The next step's loads first (the last program's one past K loads nothing; the
        # others' is the next split's first step, read and not used).
        k0 = step * BLOCK_K
        next_packed, next_mul, next_add = _step_codes(
            q_ptr, s_ptr, z_ptr, offs_n, k0 + BLOCK_K, N, K, KH, stride_qn, stride_sn,
            FORMAT, GROUP, BLOCK_K, EVEN_K,
        )  # fmt: skip
        next_even, next_odd = _step_activations(x_ptr, offs_m, k0 + BLOCK_K, M, K, stride_xm,
                                                BLOCK_K, EVEN_K)  # fmt: skip
        low, high = _weight_halves(packed, mul, add, FORMAT, GROUP, BLOCK_K)
        # The weight rounded to the activation dtype, as the reference multiplies it.
        low = (low * global_scale).to(x_ptr.dtype.element_ty)
        high = (high * global_scale).to(x_ptr.dtype.element_ty)
        if X_FP32:  # fp32 activations: a true fp32 product, not TF32
            acc = tl.dot(low, x_even, acc, input_precision="ieee")
            acc = tl.dot(high, x_odd, acc, input_precision="ieee")
        else:
            acc = tl.dot(low, x_even, acc)
            acc = tl.dot(high, x_odd, acc)
        packed, mul, add, x_even, x_odd = next_packed, next_mul, next_add, next_even, next_odd
    finish_tile(acc, partials_ptr, arrived_ptr, bias_ptr, out_ptr, offs_n, offs_m, offs_n < N,
                offs_m < M, M, N, stride_om, HAS_BIAS, SPLIT)  # fmt: skip


@triton.jit
def _dequantize_kernel(
    q_ptr, s_ptr, z_ptr, g_ptr, w_ptr, N, K, KH, stride_qn, stride_sn, stride_wn,
    FORMAT: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """W [N, K] in w's dtype, each value rounded once from fp32 (bit-exact vs the reference)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    packed, mul, add = _step_codes(q_ptr, s_ptr, z_ptr, offs_n, k0, N, K, KH, stride_qn,
                                   stride_sn, FORMAT, GROUP, BLOCK_K, False)  # fmt: skip
    low, high = _weight_halves(packed, mul, add, FORMAT, GROUP, BLOCK_K)
    global_scale = _global_scale(g_ptr, FORMAT)
    w = tl.reshape(tl.join(low * global_scale, high * global_scale), (BLOCK_N, BLOCK_K))
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    tl.store(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
             w.to(w_ptr.dtype.element_ty), mask=mask)  # fmt: skip


# ---- configs and launchers ---------------------------------------------------------------------


def gemv_config(n: int, k: int) -> dict:
    """8 weight rows x 1024 K (4 KB of codes) per step, the shape of the FP8 GEMV's best."""
    return {"BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 1}


def small_m_config(m: int, n: int, k: int, device: torch.device) -> dict:
    """64 weight rows x the tokens (16..128) x 128 K per step, split to ~2 programs per SM."""
    block_n, block_m, block_k = 64, min(128, max(16, triton.next_power_of_2(m))), 128
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = split_count(tiles, triton.cdiv(k, block_k), MIN_STEPS_PER_SPLIT, 2, device)
    return {"BLOCK_N": block_n, "BLOCK_M": block_m, "BLOCK_K": block_k, "SPLIT_K": split,
            "num_warps": 4, "num_stages": 3}  # fmt: skip


def kernel_for(m: int, config: dict | None) -> str:
    """Which kernel runs M tokens: "gemv", "small_m" or "dequantize" (+ cuBLAS); a config
    names its kernel by its keys (SPLIT_K: small-M, else a GEMV config)."""
    if config is not None:
        return "small_m" if "SPLIT_K" in config else "gemv"
    if m <= GEMV_MAX_M:
        return "gemv"
    return "small_m" if m <= FUSED_MAX_M else "dequantize"


def _scale_arg(scale: torch.Tensor) -> torch.Tensor:
    # e8m0 scales are read as their bytes (the kernel builds 2**(e - 127) from them).
    return scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale


def dequantize_launch(fmt: Format, qdata, scale, zero, global_scale, group: int, k: int,
                      dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    n = qdata.shape[0]
    w = torch.empty((n, k), dtype=dtype, device=qdata.device)
    if n == 0 or k == 0:
        return w
    block_n, block_k = 32, 128
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _dequantize_kernel[grid](
        qdata, _scale_arg(scale), zero if zero.numel() else qdata, global_scale, w, n, k,
        qdata.shape[1], qdata.stride(0), scale.stride(0), w.stride(0),
        FORMAT=int(fmt), GROUP=group, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return w


def linear_launch(fmt: Format, x, qdata, scale, zero, global_scale, bias, group: int,
                  config: dict | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K] -> x @ W.T + bias [M, N] in x's dtype, by the kernel `kernel_for` picks.
    `zero` and `global_scale` are read only by the formats that have them (pass any tensor)."""
    m, k = x.shape
    n = qdata.shape[0]
    kernel = kernel_for(m, config)
    # The reference adds the bias rounded to the activation dtype; the kernels add it in fp32.
    bias = bias.to(x.dtype) if bias is not None else None
    if kernel == "dequantize":
        weight = dequantize_launch(fmt, qdata, scale, zero, global_scale, group, k, x.dtype)
        return F.linear(x, weight, bias)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    common = dict(FORMAT=int(fmt), GROUP=group, HAS_BIAS=bias is not None)
    zero = zero if zero.numel() else qdata  # an empty tensor may have no address to pass
    args = (x, qdata, _scale_arg(scale), zero, global_scale, bias if bias is not None else out, out)
    if kernel == "gemv":
        config = dict(config or gemv_config(n, k))
        grid = (triton.cdiv(n, config["BLOCK_N"]) * m,)
        _gemv_kernel[grid](*args, m, n, k, qdata.shape[1], x.stride(0), qdata.stride(0),
                           scale.stride(0), out.stride(0), EVEN_K=k % config["BLOCK_K"] == 0,
                           **common, **config)  # fmt: skip
        return out
    config = dict(config or small_m_config(m, n, k, x.device))
    if INTERPRETED:  # the interpreter runs one program at a time, sequentially
        config.update(num_stages=1)
    steps = triton.cdiv(k, config["BLOCK_K"])
    steps_per_split = triton.cdiv(steps, min(config.pop("SPLIT_K"), max(steps, 1)))
    split = triton.cdiv(steps, steps_per_split) if steps else 1
    grid = (triton.cdiv(n, config["BLOCK_N"]), split, triton.cdiv(m, config["BLOCK_M"]))
    partials, arrived = workspace(m, n, split, grid[0] * grid[2], x.device) if split > 1 else (
        out, out)  # fmt: skip
    _small_m_kernel[grid](
        *args, partials, arrived, m, n, k, qdata.shape[1], steps_per_split,
        x.stride(0), qdata.stride(0), scale.stride(0), out.stride(0),
        X_FP32=x.dtype == torch.float32, SPLIT=split > 1, EVEN_K=k % config["BLOCK_K"] == 0,
        **common, **config,
    )  # fmt: skip
    return out


# ---- torch.library ops -------------------------------------------------------------------------


def _run(fmt: Format, x, qdata, scale, zero, global_scale, bias, group):
    k, n = x.shape[-1], qdata.shape[0]
    x2d = x.reshape(-1, k).contiguous()
    bias = bias.contiguous() if bias is not None else None  # the kernels read it with stride 1
    out = linear_launch(fmt, x2d, qdata.contiguous(), scale.contiguous(), zero.contiguous(),
                        global_scale, bias, group)  # fmt: skip
    return out.reshape(*x.shape[:-1], n)


@torch.library.custom_op("qshard::int4_linear", mutates_args=())
def int4_linear(
    x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
    bias: torch.Tensor | None, group: int,
) -> torch.Tensor:  # fmt: skip
    """y = x @ W.T + bias for the int4 weight (qdata, scale, zero; an empty zero: symmetric)."""
    fmt = Format.INT4_SYM if zero.numel() == 0 else Format.INT4_ASYM
    return _run(fmt, x, qdata, scale, zero, scale, bias, group)


@torch.library.custom_op("qshard::mxfp4_linear", mutates_args=())
def mxfp4_linear(
    x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
    group: int,
) -> torch.Tensor:  # fmt: skip
    """y = x @ W.T + bias for the MXFP4 weight (qdata, e8m0 scale)."""
    return _run(Format.MXFP4, x, qdata, scale, qdata, qdata, bias, group)


@torch.library.custom_op("qshard::nvfp4_linear", mutates_args=())
def nvfp4_linear(
    x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
    bias: torch.Tensor | None, group: int,
) -> torch.Tensor:  # fmt: skip
    """y = x @ W.T + bias for the NVFP4 weight (qdata, e4m3 scale, fp32 global scale)."""
    return _run(Format.NVFP4, x, qdata, scale, qdata, global_scale, bias, group)


@int4_linear.register_fake
def _(x, qdata, scale, zero, bias, group):
    return x.new_empty((*x.shape[:-1], qdata.shape[0]))


@mxfp4_linear.register_fake
def _(x, qdata, scale, bias, group):
    return x.new_empty((*x.shape[:-1], qdata.shape[0]))


@nvfp4_linear.register_fake
def _(x, qdata, scale, global_scale, bias, group):
    return x.new_empty((*x.shape[:-1], qdata.shape[0]))
