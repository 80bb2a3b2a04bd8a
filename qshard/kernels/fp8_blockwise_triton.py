"""FP8 blockwise W8A8 kernels in Triton: per-token-group activation quantization and the GEMM.

Layers: @triton.jit kernels -> launchers (tile choice by shape) -> torch.library ops with fake
implementations (`torch.ops.qshard.fp8_act_quant` here; the matmul op, which also picks between
this GEMM and cuBLAS, is `torch.ops.qshard.fp8_blockwise_linear` in `fp8_blockwise_gpu.py`).
Their definition is `fp8_blockwise.py`'s reference; tests compare against it (bit for bit for
the activation quantization, within fp32 summation order for the GEMM).

GEMM: y[m, n] = sum over activation groups g of
    (sum_{k in g} xq[m, k] * wq[n, k]) * (x_scale[m, g] * w_scale[n // bn, k // bk])
The fp8 dot of one group is accumulated by the tensor cores, then promoted to fp32 with its
scales (DeepSeek-V3 §3.3.2), so BLOCK_K is the activation group (128, or 64 after re-blocking).
Activation scales are stored group-major, [ceil(K/group), M] (M contiguous): the GEMM reads a
row of them per K step, coalesced, and it is the layout cuBLAS wants for its 1x128 scales.

Decode sizes (M <= GEMV_MAX_M) run a GEMV-like kernel instead, with the activation quantization
fused: each program quantizes the activation row in registers (cheap: one row) and streams a
narrow band of weight rows several groups per step, so that enough programs and enough bytes are
in flight to read the weights at HBM speed; each group's partial sums are reduced in fp32 and
promoted with their scales as in the GEMM. (A first version fused the quantization into the
tensor-core GEMM at BLOCK_M = 16 instead: 0.14x of bf16 at M = 1 on H200, docs/kernels.)

Runs on the GPU (sm_89+: Triton's fp8 dot), and on the CPU under TRITON_INTERPRET=1 for tests.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .fp8_blockwise import E4M3_MAX
from .split_k import finish_tile, split_count, workspace

__all__ = [
    "GEMV_MAX_M",
    "act_quant",
    "act_quant_launch",
    "gemm_config",
    "gemv_config",
    "linear_launch",
    "small_m_config",
    "triton_kernel_for",
]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Up to this many tokens the GEMV-like kernel runs. Each token re-reads the weights (from L2):
# on H200 the Llama layer took 73 us at M = 1 but 169 us at M = 4, where cuBLAS takes ~100.
GEMV_MAX_M = 1
# Up to this many tokens the small-M (swap-AB, split-K) kernel; the tensor-core GEMM above (and
# cuBLAS is faster from M = 128 on H200: fp8_blockwise_gpu.py picks it there).
SMALL_M_MAX = 64
MIN_GROUPS_PER_SPLIT = 4


@triton.jit
def _round_up_to_power_of_two(scale):
    """UE8M0: the smallest power of two >= scale, on the bits (as the reference)."""
    bits = scale.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    has_mantissa = ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return ((exponent + has_mantissa) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_e4m3_grid(v):
    """fp32 values in [-448, 448] rounded to nearest-even e4m3 values, still in fp32: normals
    keep 3 mantissa bits (a carry moves into the exponent), subnormals are multiples of 2**-9
    (adding and subtracting 1.5 * 2**14 rounds the magnitude there). Used under the Triton
    interpreter, whose fp32 -> e4m3 cast (triton 3.9) drops the carry (124.3 -> 64, not 128)."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    magnitude = (tl.abs(v) + 24576.0) - 24576.0
    subnormal = tl.where(v < 0, -magnitude, magnitude)  # keeps the sign of a zero (-0.0)
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def _quantize_rows(x, UE8M0: tl.constexpr, EXACT_CAST: tl.constexpr, EXACT_DIV: tl.constexpr):
    """[rows, group] fp32 -> (e4m3 [rows, group], fp32 scales [rows]), as the reference:
    scale = amax / 448 (1.0 for an all-zero group), q = clamp(x / scale) rounded to nearest.
    Both ways give the correctly rounded quotient (Triton's default fp32 `/` is approximate):
    EXACT_DIV divides each value with div_rn (a ~10-instruction sequence); otherwise (the fused
    GEMM paths, which redo this per program) q0 = x * RN(1 / scale) is corrected with two FMAs
    (Markstein: q = q0 + (x - q0 * scale) * RN(1 / scale)). Without the correction, bf16
    activations often land on e4m3 rounding midpoints and 0.05 % of codes differed (review).
    A subnormal scale (amax < 448 * 2**-126) would overflow 1 / scale: such groups are scaled by
    2**64 first, exactly, and the stored scale is unchanged."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    scale = tl.where(scale > 0, scale, 1.0)
    if UE8M0:
        scale = _round_up_to_power_of_two(scale)
    if EXACT_DIV:
        q = tl.math.div_rn(x, scale[:, None])
    else:
        tiny = scale < 1.1754943508222875e-38  # 2**-126
        divisor = tl.where(tiny, scale * 18446744073709551616.0, scale)[:, None]  # * 2**64
        x = tl.where(tiny[:, None], x * 18446744073709551616.0, x)
        reciprocal = tl.math.div_rn(tl.full(divisor.shape, 1.0, tl.float32), divisor)
        q0 = x * reciprocal
        q = tl.fma(tl.fma(-q0, divisor, x), reciprocal, q0)
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    if EXACT_CAST:
        q = _round_to_e4m3_grid(q)
    return q.to(tl.float8e4nv), scale


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm,
    GROUP: tl.constexpr, UE8M0: tl.constexpr, EXACT_CAST: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    q, scale = _quantize_rows(x.to(tl.float32), UE8M0, EXACT_CAST, True)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=mask)
    tl.store(s_ptr + g * M + rows, scale, mask=rows < M)


@triton.jit
def _gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
    M, N, K, stride_am, stride_wn, stride_wsn, stride_om,
    W_BLOCK_N: tl.constexpr, W_BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    # Grouped tile order: GROUP_M row tiles share each weight tile while it is in L2.
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * tiles_n)) * GROUP_M
    group_rows = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_rows
    pid_n = (pid % (GROUP_M * tiles_n)) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, GROUP)
    m_ok, n_ok = offs_m < M, offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    w_scale_ptrs = w_scale_ptr + (offs_n // W_BLOCK_N) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, tl.cdiv(K, GROUP)):
        if EVEN_K:
            a_mask, w_mask = m_ok[:, None], n_ok[:, None]
        else:
            k_ok = offs_k < K - g * GROUP
            a_mask, w_mask = m_ok[:, None] & k_ok[None, :], n_ok[:, None] & k_ok[None, :]
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        a_scale = tl.load(a_scale_ptr + g * M + offs_m, mask=m_ok, other=0.0)
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        w_scale = tl.load(w_scale_ptrs + (g * GROUP) // W_BLOCK_K, mask=n_ok, other=0.0)
        partial = tl.dot(a, tl.trans(w))
        acc += partial * (a_scale[:, None] * w_scale[None, :])
        a_ptrs += GROUP
        w_ptrs += GROUP
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_wsn, stride_om,
    W_BLOCK_N: tl.constexpr, W_BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    UE8M0: tl.constexpr, EXACT_CAST: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, GROUPS_PER_STEP: tl.constexpr,
):  # fmt: skip
    """out[m, n-band] for one token m: quantize x[m] per group in registers, stream the band's
    weights GROUPS_PER_STEP groups at a time, reduce each group's products in fp32."""
    pid = tl.program_id(0)
    m = pid % M  # the programs of one weight band run together and share it through L2
    offs_n = (pid // M) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    STEP: tl.constexpr = GROUP * GROUPS_PER_STEP
    offs_k = tl.arange(0, STEP)
    offs_g = tl.arange(0, GROUPS_PER_STEP)
    x_ptrs = x_ptr + m * stride_xm + offs_k
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    w_scale_ptrs = w_scale_ptr + (offs_n // W_BLOCK_N)[:, None] * stride_wsn
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, STEP):
        if EVEN_K:
            x = tl.load(x_ptrs).to(tl.float32)
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            g_ok = offs_g < GROUPS_PER_STEP
        else:
            k_ok = offs_k < K - k0
            x = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            g_ok = offs_g < tl.cdiv(K - k0, GROUP)
        rows = tl.reshape(x, (GROUPS_PER_STEP, GROUP))
        xq, x_scale = _quantize_rows(rows, UE8M0, EXACT_CAST, False)
        products = w.to(tl.float32) * tl.reshape(xq.to(tl.float32), (STEP,))[None, :]
        partial = tl.sum(tl.reshape(products, (BLOCK_N, GROUPS_PER_STEP, GROUP)), axis=2)
        w_scale = tl.load(
            w_scale_ptrs + (k0 + offs_g * GROUP)[None, :] // W_BLOCK_K,
            mask=n_ok[:, None] & g_ok[None, :], other=0.0,
        )  # fmt: skip
        acc += tl.sum(partial * (x_scale[None, :] * w_scale), axis=1)
        x_ptrs += STEP
        w_ptrs += STEP
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _small_m_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, partials_ptr, arrived_ptr,
    M, N, K, groups_per_split, stride_xm, stride_wn, stride_wsn, stride_om,
    W_BLOCK_N: tl.constexpr, W_BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    UE8M0: tl.constexpr, EXACT_CAST: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr, PREQUANT: tl.constexpr,
):  # fmt: skip
    """Small M, "swap AB": the weight rows are the MMA's M side (64+ rows fill a wgmma) and the
    few tokens its N side, out.T[n-tile, m-tile] = W[n-tile] @ xq.T. The activation tile is
    quantized in registers per group (fused: no act-quant kernel, no scales round trip), or with
    PREQUANT read quantized (x_ptr e4m3, x_scale_ptr group-major scales). The K
    groups are split over programs so that N/BLOCK_N tiles still fill every SM (SPLIT: several
    programs per tile, summed as `split_k.py` describes)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first_group = tl.program_id(1) * groups_per_split
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok, m_ok = offs_n < N, offs_m < M
    offs_k = first_group * GROUP + tl.arange(0, GROUP)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    w_scale_ptrs = w_scale_ptr + (offs_n // W_BLOCK_N) * stride_wsn
    last_group = tl.minimum(first_group + groups_per_split, tl.cdiv(K, GROUP))
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for g in range(first_group, last_group):
        if EVEN_K:
            x_mask, w_mask = m_ok[:, None], n_ok[:, None]
        else:
            k_ok = offs_k < K - (g - first_group) * GROUP
            x_mask, w_mask = m_ok[:, None] & k_ok[None, :], n_ok[:, None] & k_ok[None, :]
        if PREQUANT:
            xq = tl.load(x_ptrs, mask=x_mask, other=0.0)
            x_scale = tl.load(x_scale_ptr + g * M + offs_m, mask=m_ok, other=0.0)
        else:  # padded rows quantize to 0 with scale 1
            x = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)
            xq, x_scale = _quantize_rows(x, UE8M0, EXACT_CAST, False)
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        w_scale = tl.load(w_scale_ptrs + (g * GROUP) // W_BLOCK_K, mask=n_ok, other=0.0)
        partial = tl.dot(w, tl.trans(xq))
        acc += partial * (w_scale[:, None] * x_scale[None, :])
        x_ptrs += GROUP
        w_ptrs += GROUP
    finish_tile(acc, partials_ptr, arrived_ptr, bias_ptr, out_ptr, offs_n, offs_m, n_ok, m_ok, M, N,
                stride_om, HAS_BIAS, SPLIT)  # fmt: skip


# ---- launchers ---------------------------------------------------------------------------------


def act_quant_launch(x: torch.Tensor, group: int, ue8m0: bool):
    """[M, K] float -> (e4m3 [M, K], fp32 scales [ceil(K/group), M] group-major)."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((-(-k // group), m), dtype=torch.float32, device=x.device)
    if m and k:
        block_m = 16 if m >= 16 else 1 << (m - 1).bit_length()
        grid = (triton.cdiv(m, block_m), triton.cdiv(k, group))
        _act_quant_kernel[grid](
            x, q, scales, m, k, x.stride(0), q.stride(0),
            GROUP=group, UE8M0=ue8m0, EXACT_CAST=INTERPRETED, BLOCK_M=block_m, num_warps=4,
        )  # fmt: skip
    return q, scales


def triton_kernel_for(m: int) -> str:
    """Which Triton kernel serves M tokens (H200 sweep, docs/kernels/fp8_blockwise.md)."""
    if m <= GEMV_MAX_M:
        return "gemv"
    if m <= SMALL_M_MAX:
        return "small_m"
    return "gemm"


def gemm_config(m: int, n: int, k: int) -> dict:
    """Tensor-core tiles by M; from the H200 sweep (bench/bench_fp8.py --sweep, bench/README.md)."""
    if m <= 64:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}
    if m <= 256:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}


def gemv_config(m: int, n: int, k: int, group: int) -> dict:
    """A narrow band of weight rows per program (many programs), 1024 K per step: the best of
    the H200 sweeps (8 rows x 8 groups of 128: 69-74 us for the Llama layer at M = 1)."""
    return {"BLOCK_N": 8, "GROUPS_PER_STEP": max(1, 1024 // group), "num_warps": 4,
            "num_stages": 3}  # fmt: skip


# The small-M kernel's tiles by M (H200 sweep, docs/kernels/fp8_blockwise.md): (largest M,
# weight rows per tile, programs per SM, pipeline stages, warps, quantize activations apart).
SMALL_M_TABLE = (
    (8, 64, 4, 4, 4, True),
    (16, 128, 2, 4, 8, False),
    (32, 64, 4, 4, 4, True),
    (64, 128, 2, 3, 8, True),
)


def small_m_config(
    m: int, n: int, k: int, group: int, device: torch.device, block_n: int | None = None,
    waves: float = 2, num_stages: int = 4, num_warps: int = 4, prequant: bool = False,
    max_block_m: int = 64,
) -> dict:  # fmt: skip
    """Tiles of `block_n` weight rows x the tokens (16..max_block_m), and the K groups split so
    that about `waves` programs per SM run, each streaming >= MIN_GROUPS_PER_SPLIT groups.
    Without `block_n`, the tuned row of SMALL_M_TABLE for M."""
    if block_n is None:
        row = next((r for r in SMALL_M_TABLE if m <= r[0]), SMALL_M_TABLE[-1])
        block_n, waves, num_stages, num_warps, prequant = row[1:]
    block_m = min(max_block_m, max(16, triton.next_power_of_2(m)))
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = split_count(tiles, triton.cdiv(k, group), MIN_GROUPS_PER_SPLIT, waves, device)
    return {"BLOCK_N": block_n, "BLOCK_M": block_m, "SPLIT_K": split, "PREQUANT": prequant,
            "num_warps": num_warps, "num_stages": num_stages}  # fmt: skip


def linear_launch(
    x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
    block_n: int, block_k: int, group: int, ue8m0: bool, config: dict | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] float -> x @ W.T + bias [M, N] in x's dtype, by the kernel `triton_kernel_for`
    picks (or the one `config` names: "GROUPS_PER_STEP" the GEMV, "SPLIT_K" the small-M
    kernel, "GROUP_M" the tensor-core GEMM after the act-quant kernel)."""
    m, k = x.shape
    n = qdata.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n) if bias is not None else out.zero_())
    if config is None:
        kernel = triton_kernel_for(m)
        config = {
            "gemv": lambda: gemv_config(m, n, k, group),
            "small_m": lambda: small_m_config(m, n, k, group, x.device),
            "gemm": lambda: gemm_config(m, n, k),
        }[kernel]()
    config = dict(config)
    if INTERPRETED:  # the interpreter runs one program at a time, sequentially
        config.update(num_stages=1)
    common = dict(W_BLOCK_N=block_n, W_BLOCK_K=block_k, GROUP=group, HAS_BIAS=bias is not None)
    bias_arg = bias if bias is not None else out
    if "GROUPS_PER_STEP" in config:
        step = group * config["GROUPS_PER_STEP"]
        grid = (triton.cdiv(n, config["BLOCK_N"]) * m,)
        _gemv_kernel[grid](
            x, qdata, scale, bias_arg, out,
            m, n, k, x.stride(0), qdata.stride(0), scale.stride(0), out.stride(0),
            UE8M0=ue8m0, EXACT_CAST=INTERPRETED, EVEN_K=k % step == 0, **common, **config,
        )  # fmt: skip
        return out
    if "SPLIT_K" in config:
        return _small_m_launch(x, qdata, scale, bias, out, ue8m0, common, config)
    a, a_scale = act_quant_launch(x, group, ue8m0)
    grid = (triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"]),)
    _gemm_kernel[grid](
        a, a_scale, qdata, scale, bias_arg, out,
        m, n, k, a.stride(0), qdata.stride(0), scale.stride(0), out.stride(0),
        EVEN_K=k % group == 0, **common, **config,
    )  # fmt: skip
    return out


def _small_m_launch(x, qdata, scale, bias, out, ue8m0, common, config):
    m, k = x.shape
    n = qdata.shape[0]
    group = common["GROUP"]
    groups = triton.cdiv(k, group)
    split = min(config.pop("SPLIT_K"), groups)
    groups_per_split = triton.cdiv(groups, split)
    split = triton.cdiv(groups, groups_per_split)  # no program without a group
    config.setdefault("PREQUANT", False)
    x, x_scale = act_quant_launch(x, group, ue8m0) if config["PREQUANT"] else (x, x)
    grid = (triton.cdiv(n, config["BLOCK_N"]), split, triton.cdiv(m, config["BLOCK_M"]))
    tiles = grid[0] * grid[2]
    partials, arrived = workspace(m, n, split, tiles, x.device) if split > 1 else (out, out)
    _small_m_kernel[grid](
        x, x_scale, qdata, scale, bias if bias is not None else out, out, partials, arrived,
        m, n, k, groups_per_split, x.stride(0), qdata.stride(0), scale.stride(0), out.stride(0),
        UE8M0=ue8m0, EXACT_CAST=INTERPRETED, EVEN_K=k % group == 0, SPLIT=split > 1,
        **common, **config,
    )  # fmt: skip
    return out


# ---- torch.library ops -------------------------------------------------------------------------


@torch.library.custom_op("qshard::fp8_act_quant", mutates_args=())
def act_quant(x: torch.Tensor, group: int, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group e4m3 quantization: (q [M, K], scales [ceil(K/group), M])."""
    return act_quant_launch(x.contiguous(), group, ue8m0)


@act_quant.register_fake
def _(x, group, ue8m0):
    m, k = x.shape
    q = x.new_empty((m, k), dtype=torch.float8_e4m3fn)
    return q, x.new_empty((-(-k // group), m), dtype=torch.float32)


assert E4M3_MAX == 448.0  # the kernels hard-code the e4m3 range
